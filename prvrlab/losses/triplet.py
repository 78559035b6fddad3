"""Bidirectional triplet ranking loss on cosine scores (MS-SL / GMMFormer style).

Query -> video: the positive of query i is ``sim[i, query_video[i]]``; its
negative is one video sampled among the videos it does not belong to.
Video -> query: the positive of video v is the mean score of its queries; its
negative is one query sampled among the other videos' queries.  Before epoch
``hard_negative_start_epoch`` negatives are drawn uniformly among all
non-matching items; from then on uniformly among the ``hard_pool_size``
highest-scoring (hardest) non-matching videos of a query, and among the
``v2t_hard_pool_size`` hardest non-matching queries of a video (1 by default:
the hardest, as the reference code does).  With hinge
``h = max(0, margin + neg - pos)``::

    loss = sum_i h_i / N_q + sum_v h_v / N_v

An item without any non-matching candidate (e.g. a batch of one video)
contributes 0.  Where the branch sets ``targets`` (MS-SL's official training
frame scores: (Nq, Nq), each column one query's own-video vector) they are the
positives instead of the batch's ``query_video``, one per column.  Sampling uses the global torch RNG (seeded by the trainer)
unless :meth:`TripletLoss.compute` is given a ``torch.Generator``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from prvrlab.data.batch import Batch
from prvrlab.checks import check_int, check_number
from prvrlab.losses._common import branch_scores, check_branch, positive_mask, positives
from prvrlab.losses.base import Loss
from prvrlab.models.base import ModelOutput
from prvrlab.registry import LOSSES


def sample_negatives(
    hardness: Tensor, negatives: Tensor, pool_size: int | None, generator: torch.Generator | None = None
) -> Tensor:
    """One negative column per row, -1 for rows without a negative.

    ``hardness`` (N, M) scores (higher = harder), ``negatives`` (N, M) bool
    candidates.  ``pool_size`` None: uniform among all candidates; otherwise
    uniform among the ``pool_size`` hardest candidates of the row.
    """
    eligible = negatives
    if pool_size is not None and pool_size < negatives.shape[1]:
        ranked = hardness.detach().float().masked_fill(~negatives, float("-inf"))  # (N, M)
        top = ranked.topk(pool_size, dim=1).indices  # (N, k)
        in_pool = torch.zeros_like(negatives).scatter_(1, top, True)  # (N, M)
        eligible = negatives & in_pool
    priority = torch.rand(eligible.shape, generator=generator, device=eligible.device)  # (N, M)
    priority = priority.masked_fill(~eligible, -1.0)
    choice = priority.argmax(dim=1) if eligible.shape[1] else eligible.new_zeros(eligible.shape[0], dtype=torch.long)
    return torch.where(eligible.any(dim=1), choice, torch.full_like(choice, -1))  # (N,)


@dataclass
class TripletTerms:
    """The loss and what it was computed from (for inspection and tests)."""

    loss: Tensor  # () scalar
    t2v: Tensor  # (Nq,) hinge of each query
    v2t: Tensor  # (Nv,) hinge of each video
    t2v_negative: Tensor  # (Nq,) long, sampled negative video of each query (-1: none)
    v2t_negative: Tensor  # (Nv,) long, sampled negative query of each video (-1: none)


@LOSSES.register("triplet")
class TripletLoss(Loss):
    """Triplet ranking loss on ``out.scores[branch].sim`` in both directions."""

    def __init__(
        self,
        *,
        branch: str = "clip",
        margin: float = 0.1,
        hard_negative_start_epoch: int = 20,
        hard_pool_size: int = 20,
        v2t_hard_pool_size: int = 1,
    ) -> None:
        super().__init__()
        self.branch = check_branch(branch)
        self.margin = check_number(margin, "margin", minimum=0.0)
        self.hard_negative_start_epoch = check_int(hard_negative_start_epoch, "hard_negative_start_epoch", minimum=0)
        self.hard_pool_size = check_int(hard_pool_size, "hard_pool_size", minimum=1)
        self.v2t_hard_pool_size = check_int(v2t_hard_pool_size, "v2t_hard_pool_size", minimum=1)

    def forward(self, out: ModelOutput, batch: Batch, *, epoch: int) -> Tensor:
        scores = branch_scores(out, self.branch, "triplet")
        return self.compute(scores.sim, positives(scores, batch), epoch=epoch).loss  # sim (Nq, B)

    def compute(
        self,
        sim: Tensor,
        query_video: Tensor,
        *,
        epoch: int,
        generator: torch.Generator | None = None,
        ignore: Tensor | None = None,
    ) -> TripletTerms:
        """The loss of (Nq, Nv) cosine scores; ``query_video`` (Nq,) long; ``ignore`` (Nq, Nv) bool: entries
        that are neither positive nor negative (never drawn as a negative; a positive is never ignored)."""
        sim = sim.float()
        nq, nv = sim.shape
        if nq == 0 or nv == 0:
            zero = sim.sum() * 0.0
            none = torch.full((nq,), -1, dtype=torch.long, device=sim.device)
            return TripletTerms(zero, sim.new_zeros(nq), sim.new_zeros(nv), none, none.new_full((nv,), -1))
        hard = epoch >= self.hard_negative_start_epoch
        pool = self.hard_pool_size if hard else None
        v2t_pool = self.v2t_hard_pool_size if hard else None
        pos_mask = positive_mask(query_video, nv)  # (Nq, Nv)
        negative = ~pos_mask if ignore is None else ~pos_mask & ~ignore.to(pos_mask.device)  # (Nq, Nv)
        rows = torch.arange(nq, device=sim.device)

        t2v_neg = sample_negatives(sim, negative, pool, generator)  # (Nq,)
        t2v_pos = sim[rows, query_video]  # (Nq,)
        t2v_negs = sim[rows, t2v_neg.clamp(min=0)]  # (Nq,)
        t2v = (self.margin + t2v_negs - t2v_pos).clamp(min=0) * (t2v_neg >= 0)  # (Nq,)

        sim_t = sim.t()  # (Nv, Nq)
        pos_t = pos_mask.t()  # (Nv, Nq)
        count = pos_t.sum(dim=1)  # (Nv,)
        v2t_pos = (sim_t * pos_t).sum(dim=1) / count.clamp(min=1)  # (Nv,)
        v2t_neg = sample_negatives(sim_t, negative.t(), v2t_pool, generator)  # (Nv,)
        v2t_negs = sim_t[torch.arange(nv, device=sim.device), v2t_neg.clamp(min=0)]  # (Nv,)
        valid = (v2t_neg >= 0) & (count > 0)  # (Nv,)
        v2t = (self.margin + v2t_negs - v2t_pos).clamp(min=0) * valid  # (Nv,)

        loss = t2v.sum() / max(nq, 1) + v2t.sum() / max(nv, 1)
        return TripletTerms(loss=loss, t2v=t2v, v2t=v2t, t2v_negative=t2v_neg, v2t_negative=v2t_neg)
