"""InfoNCE on unnormalised query-video dot products (no temperature).

With ``s = out.scores[branch].logits`` (Nq, Nv) and P_v the queries of video v::

    t2v_i = logsumexp_v s[i, v] - s[i, video(i)]                     (one positive)
    v2t_v = logsumexp_i s[i, v] - logsumexp_{i in P_v} s[i, v]       (all of v's queries positive)
    loss  = mean_i t2v_i + mean_{v : |P_v| > 0} v2t_v

i.e. the sum of the two directions' means, as the reference code reduces it
(it averages over all videos of the batch, each of which has queries there;
a video without queries in the batch is left out of the mean here).  This is
``form: two_sided``, the default (MS-SL's ``clip_nce``, GMMFormer's NCE).

``form: joint`` is MS-SL's official ``frame_nce``: one softmax per query over
its row and its positive's column together (the positive counted in both)::

    joint_i = logsumexp( s[i, :] ++ s[K_i, video(i)] ) - s[i, video(i)]
    loss    = mean_i joint_i

with K_i every query k except i's siblings (k != i with video(k) = video(i)):
their entry in that column is their own positive, which as i's negative would
make sibling queries compete for their video's score (a floor of log(M + 1)
for a video of M queries that no model can go below).  The positive columns
come from the branch's ``targets`` where it sets them (MS-SL's official
training frame scores, a square matrix with its positives on the diagonal,
:class:`~prvrlab.models.base.BranchScores`: every query its own column, so K_i
is every query, as the official code), else from the batch's ``query_video``
((Nq, Nv) scores: RAL's CSA on MS-SL, ``model.frame_training: all_pairs``).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from prvrlab.data.batch import Batch
from prvrlab.checks import check_choice
from prvrlab.losses._common import branch_scores, check_branch, positive_mask, positives
from prvrlab.losses.base import Loss
from prvrlab.models.base import ModelOutput
from prvrlab.registry import LOSSES


FORMS = ("two_sided", "joint")


def infonce(logits: Tensor, query_video: Tensor, *, form: str = "two_sided", ignore: Tensor | None = None) -> Tensor:
    """Bidirectional InfoNCE of (Nq, Nv) logits; ``query_video`` (Nq,): each query's positive column;
    ``form``: ``two_sided`` (multi-positive, the two directions' means summed) or ``joint``; ``ignore``
    (Nq, Nv) bool (``two_sided`` only): entries left out of both directions' sums (never a positive)."""
    logits = logits.float()
    nq, nv = logits.shape
    if nq == 0 or nv == 0:
        return logits.sum() * 0.0
    if ignore is not None:
        if form != "two_sided":
            raise ValueError("infonce: ignore is supported with form two_sided only")
        return _two_sided(logits, query_video, ignore.to(logits.device) & ~positive_mask(query_video, nv))
    if form == "joint":
        rows = torch.arange(nq, device=logits.device)
        positive = logits[rows, query_video]  # (Nq,)
        column = logits[:, query_video].t()  # (Nq, Nq): row i holds s[k, video(i)] for every query k
        siblings = (query_video[:, None] == query_video[None, :]) & (rows[:, None] != rows[None, :])  # (Nq, Nq)
        column = column.masked_fill(siblings, float("-inf"))  # row i always keeps k = i: finite
        return (torch.logsumexp(torch.cat([logits, column], dim=1), dim=1) - positive).mean()
    return _two_sided(logits, query_video, None)


def _two_sided(logits: Tensor, query_video: Tensor, ignore: Tensor | None) -> Tensor:
    """The ``two_sided`` form of (Nq, Nv) float logits; ``ignore`` (Nq, Nv) bool holds no positive."""
    nq, nv = logits.shape
    positive = logits[torch.arange(nq, device=logits.device), query_video]  # (Nq,)
    pos = positive_mask(query_video, nv)  # (Nq, Nv)
    has_pos = pos.any(dim=0)  # (Nv,)
    in_row = in_column = logits
    if ignore is not None:  # a row keeps its positive; a column without positives keeps its (unused) logits
        in_row = logits.masked_fill(ignore, float("-inf"))  # (Nq, Nv)
        in_column = logits.masked_fill(ignore & has_pos[None, :], float("-inf"))  # (Nq, Nv)
    t2v = torch.logsumexp(in_row, dim=1) - positive  # (Nq,)

    # Columns without positives keep their logits (finite, then ignored) so no -inf reaches the gradient.
    pos_logits = torch.where(pos | ~has_pos[None, :], logits, float("-inf"))  # (Nq, Nv)
    v2t = torch.logsumexp(in_column, dim=0) - torch.logsumexp(pos_logits, dim=0)  # (Nv,)
    v2t_mean = (v2t * has_pos).sum() / has_pos.sum().clamp(min=1)
    return t2v.mean() + v2t_mean


@LOSSES.register("infonce")
class InfoNCELoss(Loss):
    """Query->video and video->query InfoNCE on ``out.scores[branch].logits``."""

    def __init__(self, *, branch: str = "clip", form: Literal["two_sided", "joint"] = "two_sided") -> None:
        super().__init__()
        self.branch = check_branch(branch)
        self.form = check_choice(form, "form", FORMS)

    def forward(self, out: ModelOutput, batch: Batch, *, epoch: int) -> Tensor:
        scores = branch_scores(out, self.branch, "infonce")
        if scores.logits is None:
            raise ValueError(
                f"infonce: branch={self.branch!r} has no logits (unnormalised scores); "
                "this backbone does not support InfoNCE on that branch"
            )
        return infonce(scores.logits, positives(scores, batch), form=self.form)
