"""GMMFormer's query-diverse loss: push apart the queries of the same video.

With ``c_ij`` the cosine of the L2-normalised query vectors
``out.query.vectors[branch]`` and J_i the other queries of query i's video::

    l_i  = log(1 + sum_{j in J_i} exp(alpha (c_ij + delta)))
         = softplus(logsumexp_{j in J_i} alpha (c_ij + delta))      (0 when J_i is empty)
    loss = sum_i l_i / N_q

i.e. averaged over all the batch's queries as the reference code does (the
same as the mean over queries with a partner when every video has two or
more queries); 0, still attached to the graph, when no video has two queries.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from prvrlab.data.batch import Batch
from prvrlab.checks import check_number
from prvrlab.losses._common import check_branch, query_vectors
from prvrlab.losses.base import Loss
from prvrlab.models.base import ModelOutput
from prvrlab.models.component import QUERY_GROUPS
from prvrlab.registry import LOSSES


def query_diverse(vectors: Tensor, query_video: Tensor, *, alpha: float, delta: float) -> Tensor:
    """The loss of (Nq, D) query vectors grouped by ``query_video`` (Nq,)."""
    with torch.autocast(device_type=vectors.device.type, enabled=False):
        q = F.normalize(vectors.float(), dim=-1)  # (Nq, D)
        cos = q @ q.t()  # (Nq, Nq)
    n = q.shape[0]
    eye = torch.eye(n, dtype=torch.bool, device=q.device)
    partner = (query_video[:, None] == query_video[None, :]) & ~eye  # (Nq, Nq)
    has = partner.any(dim=1)  # (Nq,)
    # Rows without partners keep finite values (then weighted by 0) so no -inf reaches the gradient.
    z = torch.where(partner | ~has[:, None], alpha * (cos + delta), float("-inf"))  # (Nq, Nq)
    per_query = F.softplus(torch.logsumexp(z, dim=1))  # (Nq,)
    return (per_query * has).sum() / max(n, 1)


@LOSSES.register("query_diverse")
class QueryDiverseLoss(Loss):
    """Query-diverse loss of GMMFormer v1 on ``out.query.vectors[branch]``."""

    reads_query_vectors = True

    def __init__(self, *, branch: str = "clip", alpha: float = 32.0, delta: float = 0.2) -> None:
        super().__init__()
        self.branch = check_branch(branch)
        self.alpha = check_number(alpha, "alpha", minimum=0.0, strict=True)
        self.delta = check_number(delta, "delta", minimum=0.0)

    def needs(self, *, training: bool) -> frozenset[str]:
        """Each video's group of queries (pushed apart from each other)."""
        return frozenset({QUERY_GROUPS})

    def forward(self, out: ModelOutput, batch: Batch, *, epoch: int) -> Tensor:
        vectors = query_vectors(out, self.branch, "query_diverse")  # (Nq, D)
        return query_diverse(vectors, batch.query_video, alpha=self.alpha, delta=self.delta)
