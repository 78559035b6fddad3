"""InfoNCE on unnormalised query-video dot products (no temperature).

With ``s = out.scores[branch].logits`` (Nq, Nv) and P_v the queries of video v::

    t2v_i = logsumexp_v s[i, v] - s[i, video(i)]                     (one positive)
    v2t_v = logsumexp_i s[i, v] - logsumexp_{i in P_v} s[i, v]       (all of v's queries positive)
    loss  = mean_i t2v_i + mean_{v : |P_v| > 0} v2t_v

i.e. the sum of the two directions' means, as the reference code reduces it
(it averages over all videos of the batch, each of which has queries there;
a video without queries in the batch is left out of the mean here).
"""

from __future__ import annotations

import torch
from torch import Tensor

from prvrlab.data.batch import Batch
from prvrlab.losses._common import branch_scores, check_branch, positive_mask
from prvrlab.losses.base import Loss
from prvrlab.models.base import ModelOutput
from prvrlab.registry import LOSSES


def infonce(logits: Tensor, query_video: Tensor) -> Tensor:
    """Bidirectional multi-positive InfoNCE of (Nq, Nv) logits; ``query_video`` (Nq,)."""
    logits = logits.float()
    nq, nv = logits.shape
    if nq == 0 or nv == 0:
        return logits.sum() * 0.0
    pos = positive_mask(query_video, nv)  # (Nq, Nv)
    rows = torch.arange(nq, device=logits.device)
    t2v = torch.logsumexp(logits, dim=1) - logits[rows, query_video]  # (Nq,)

    has_pos = pos.any(dim=0)  # (Nv,)
    # Columns without positives keep their logits (finite, then ignored) so no -inf reaches the gradient.
    pos_logits = torch.where(pos | ~has_pos[None, :], logits, float("-inf"))  # (Nq, Nv)
    v2t = torch.logsumexp(logits, dim=0) - torch.logsumexp(pos_logits, dim=0)  # (Nv,)
    v2t_mean = (v2t * has_pos).sum() / has_pos.sum().clamp(min=1)
    return t2v.mean() + v2t_mean


@LOSSES.register("infonce")
class InfoNCELoss(Loss):
    """Query->video and video->query InfoNCE on ``out.scores[branch].logits``."""

    def __init__(self, *, branch: str = "clip") -> None:
        super().__init__()
        self.branch = check_branch(branch)

    def forward(self, out: ModelOutput, batch: Batch, *, epoch: int) -> Tensor:
        scores = branch_scores(out, self.branch, "infonce")
        if scores.logits is None:
            raise ValueError(
                f"infonce: branch={self.branch!r} has no logits (unnormalised scores); "
                "this backbone does not support InfoNCE on that branch"
            )
        return infonce(scores.logits, batch.query_video)
