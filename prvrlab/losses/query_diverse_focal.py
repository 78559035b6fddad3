"""GMMFormer v2's revamped query-diverse loss: a focusing factor on every pair of same-video queries.

With ``c_ij`` the cosine of the query vectors ``out.query.vectors[branch]``
and P the ordered pairs (i, j), i != j, of queries of the same video::

    l(i, j) = (1 + c_ij)^gamma * log(1 + exp(alpha (c_ij + delta)))     (Eq. 4 of the paper)

Reductions (``reduction``):

* ``"query"`` (default, as the reference code): ``sum_{(i,j) in P} l(i, j) / N_q``,
  every ordered pair counted, divided by the number of queries in the batch;
* ``"pair"`` (the paper's Eq. 5 read as a mean): per video, the mean of
  l over its ordered pairs, then the mean over the videos with >= 2 queries.
  Eq. 5 as printed, ``2 / (M (M - 1)) * sum_{(i,j) in P_v} l(i, j)`` for a
  video of M queries, sums the M (M - 1) *ordered* pairs, so it is exactly
  2x this reduction (2x the per-pair mean); the factor folds into the
  loss weight.

``gamma = 0`` is the *uniform-push* version: every pair pushed with the
same softplus, ``sum_P softplus(alpha (c_ij + delta)) / N_q``.  It equals
GMMFormer v1's ``query_diverse`` (``log(1 + sum_j exp(...))`` per query)
exactly when every video has at most two queries (one partner each), and
bounds it from above otherwise.  The loss is 0, still attached to the
graph, when no video has two queries.
"""

from __future__ import annotations

from typing import Literal

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


def _focus(base: Tensor, pair: Tensor, gamma: float) -> Tensor:
    """``base^gamma`` of the (Nq, Nq) ``1 + cos``, with finite gradients: where ``base`` is not above
    float32's eps (antipodal queries, or below 0 by rounding) or the entry is no pair, the value is the
    same but its gradient is cut (d/dx x^gamma is infinite at 0 for gamma < 1, and 0 * inf of a masked
    entry was a NaN gradient)."""
    live = pair & (base > torch.finfo(torch.float32).eps)  # (Nq, Nq)
    return torch.where(live, torch.where(live, base, 1.0).pow(gamma), base.detach().clamp(min=0.0).pow(gamma))


def query_diverse_focal(
    vectors: Tensor,
    query_video: Tensor,
    *,
    alpha: float,
    delta: float,
    gamma: float,
    reduction: str = "query",
) -> Tensor:
    """The loss of (Nq, D) query vectors grouped by ``query_video`` (Nq,)."""
    with torch.autocast(device_type=vectors.device.type, enabled=False):
        q = F.normalize(vectors.float(), dim=-1)  # (Nq, D)
        cos = q @ q.t()  # (Nq, Nq)
    n = q.shape[0]
    eye = torch.eye(n, dtype=torch.bool, device=q.device)
    pair = (query_video[:, None] == query_video[None, :]) & ~eye  # (Nq, Nq), ordered pairs
    per_pair = F.softplus(alpha * (cos + delta))  # (Nq, Nq), finite everywhere
    if gamma != 0.0:
        per_pair = per_pair * _focus(1.0 + cos, pair, gamma)
    per_pair = per_pair * pair  # non-pairs contribute exact zeros (and zero gradient)
    if reduction == "query":
        return per_pair.sum() / max(n, 1)
    # "pair": mean over each video's ordered pairs, then over videos having pairs
    count = pair.sum(dim=1)  # (Nq,) partners of each query = M_v - 1
    videos, inverse = torch.unique(query_video, return_inverse=True)
    pairs_per_video = torch.zeros(videos.shape[0], device=q.device).index_add_(0, inverse, count.float())  # (V,)
    loss_per_video = torch.zeros(videos.shape[0], device=q.device).index_add_(0, inverse, per_pair.sum(dim=1))
    has = pairs_per_video > 0  # (V,)
    means = loss_per_video / pairs_per_video.clamp(min=1)  # (V,)
    return (means * has).sum() / has.sum().clamp(min=1)


@LOSSES.register("query_diverse_focal")
class QueryDiverseFocalLoss(Loss):
    """Revamped query-diverse loss of GMMFormer v2 on ``out.query.vectors[branch]``.

    ``alpha``: scale (> 0); ``delta``: margin (>= 0); ``gamma``: focusing
    factor (>= 0; 0 = uniform push); ``reduction``: ``"query"`` (reference
    code) or ``"pair"`` (paper's Eq. 5), see the module docstring.
    """

    reads_query_vectors = True

    def __init__(
        self,
        *,
        branch: str = "clip",
        alpha: float = 32.0,
        delta: float = 0.2,
        gamma: float = 1.0,
        reduction: Literal["query", "pair"] = "query",
    ) -> None:
        super().__init__()
        self.branch = check_branch(branch)
        self.alpha = check_number(alpha, "alpha", minimum=0.0, strict=True)
        self.delta = check_number(delta, "delta", minimum=0.0)
        self.gamma = check_number(gamma, "gamma", minimum=0.0)
        if reduction not in ("query", "pair"):
            raise ValueError(f"reduction must be 'query' or 'pair', got {reduction!r}")
        self.reduction = reduction

    def needs(self, *, training: bool) -> frozenset[str]:
        """Each video's group of queries (pushed apart from each other)."""
        return frozenset({QUERY_GROUPS})

    def forward(self, out: ModelOutput, batch: Batch, *, epoch: int) -> Tensor:
        vectors = query_vectors(out, self.branch, "query_diverse_focal")  # (Nq, D)
        return query_diverse_focal(
            vectors, batch.query_video, alpha=self.alpha, delta=self.delta, gamma=self.gamma, reduction=self.reduction
        )
