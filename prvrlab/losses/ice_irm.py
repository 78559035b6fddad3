"""L_irm = L_neg + L_red (papers/002, Sec. 3.4), on the ICE plug-in's IRM outputs.

Per query i: q_i (the moment-level query vector), its key moment m_k(i),
and the redundant features r_v(i) = FC(v - m_k), r_q(i) = FC(v - q)
(``ice.query``, ``ice.key_moment``, ``ice.redundant_video``,
``ice.redundant_query``, (Nq, D) each).

L_neg ("r_v and r_q as negative samples in the moment-level similarity
learning"): the query's own redundant features are two extra negatives of
its moment-level positive S_m = cos(q, m_k)::

    L_neg = mean_i sum_{r in {r_v(i), r_q(i)}} max(0, margin + cos(q_i, r) - cos(q_i, m_k(i)))
          + nce_weight * mean_i CE([q_i.m_k(i), q_i.r_v(i), q_i.r_q(i)], 0)       (raw dots, as L^nce)

Both negatives are used (there are only two, hard by construction); the
batch's other videos are left to the base loss, so L_neg adds only what is
new.  These two choices are ours: the paper gives no formula.

L_red ("directly align r_v and r_q", triplet + InfoNCE): the Nq pairs
(r_q(i), r_v(i)) as a mini-batch, each pair's r_v its positive
(``paired_contrastive``).  Two queries of one video with the same key moment
have the same r_v: one column, positive for both (not each other's negative).

``neg`` / ``red`` switch the terms (Table 4); ``nce_weight`` (the balance
inside each term, not in the paper) defaults to 0.04 as L_ice.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from prvrlab.checks import check_bool, check_number
from prvrlab.data.batch import Batch
from prvrlab.losses._common import plugin_aux
from prvrlab.losses._ice import paired_contrastive, pair_triplet
from prvrlab.losses.base import Loss
from prvrlab.models.base import ModelOutput
from prvrlab.registry import LOSSES

_EPS = 1e-6


def redundancy_negatives(query: Tensor, key_moment: Tensor, r_v: Tensor, r_q: Tensor, *, margin: float, nce_weight: float) -> Tensor:
    """L_neg of (Nq, D) queries, key moments and redundant features (see the module docstring)."""
    q, m, rv, rq = query.float(), key_moment.float(), r_v.float(), r_q.float()
    if q.shape[0] == 0:
        return q.sum() * 0.0
    candidates = torch.stack([m, rv, rq], dim=1)  # (Nq, 3, D) positive first
    cos = (F.normalize(candidates, dim=-1, eps=_EPS) @ F.normalize(q, dim=-1, eps=_EPS)[:, :, None]).squeeze(-1)  # (Nq, 3)
    hinge = (margin + cos[:, 1:] - cos[:, :1]).clamp(min=0).sum(dim=1)  # (Nq,)
    loss = hinge.mean()
    if nce_weight > 0:
        dots = (candidates @ q[:, :, None]).squeeze(-1)  # (Nq, 3)
        loss = loss + nce_weight * F.cross_entropy(dots, torch.zeros_like(dots[:, 0], dtype=torch.long))
    return loss


@LOSSES.register("ice_irm")
class IRMLoss(Loss):
    """``neg`` x L_neg + ``red`` x L_red (see the module docstring)."""

    switch_params: ClassVar[tuple[str, ...]] = ("neg", "red")

    def __init__(
        self,
        *,
        neg: bool = True,
        red: bool = True,
        margin: float = 0.1,
        nce_weight: float = 0.04,
        hard_negative_start_epoch: int = 20,
    ) -> None:
        super().__init__()
        self.neg = check_bool(neg, "neg")
        self.red = check_bool(red, "red")
        self.margin = check_number(margin, "margin", minimum=0.0)
        self.nce_weight = check_number(nce_weight, "nce_weight", minimum=0.0)
        self.triplet = pair_triplet(margin=margin, hard_negative_start_epoch=hard_negative_start_epoch)

    def required_aux(self) -> tuple[str, ...]:
        return ("ice.query", "ice.key_moment", "ice.redundant_video", "ice.redundant_query")

    def forward(self, out: ModelOutput, batch: Batch, *, epoch: int) -> Tensor:
        q, m, r_v, r_q = plugin_aux(out, self.required_aux(), "ice_irm")  # (Nq, D) each
        loss = r_v.float().sum() * 0.0  # keeps the FC in the graph when both terms are off
        if self.neg:
            loss = loss + redundancy_negatives(q, m, r_v, r_q, margin=self.margin, nce_weight=self.nce_weight)
        if self.red:
            loss = loss + paired_contrastive(r_q, r_v, self.triplet, self.nce_weight, epoch=epoch)
        return loss
