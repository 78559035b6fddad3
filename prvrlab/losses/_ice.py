"""Shared by the ICE / IRM losses (papers/002): triplet + InfoNCE over a mini-batch of aligned pairs."""

from __future__ import annotations

import torch
from torch import Tensor

from prvrlab.checks import check_int, check_number
from prvrlab.losses.infonce import infonce
from prvrlab.losses.triplet import TripletLoss
from prvrlab.models.plugins.ice import cosine_matrix


def pair_triplet(*, margin: float, hard_negative_start_epoch: int) -> TripletLoss:
    """The triplet loss of the pair mini-batches (hardest in-batch negative from ``hard_negative_start_epoch``)."""
    check_number(margin, "margin", minimum=0.0)
    check_int(hard_negative_start_epoch, "hard_negative_start_epoch", minimum=0)
    return TripletLoss(
        branch="pairs", margin=margin, hard_negative_start_epoch=hard_negative_start_epoch, hard_pool_size=1
    )


def paired_contrastive(anchor: Tensor, target: Tensor, triplet: TripletLoss, nce_weight: float, *, epoch: int) -> Tensor:
    """L^trip + nce_weight * L^nce of n aligned pairs (anchor_i, target_i), (n, D) each.

    The n x n matrix has anchors as rows ("queries") and targets as columns
    ("videos"), the diagonal positive: the triplet loss on cosines (both
    directions, :class:`TripletLoss`) and InfoNCE on raw dot products (both
    directions, :func:`infonce`), as the base model's L^trip / L^nce.
    """
    a, b = anchor.float(), target.float()
    diagonal = torch.arange(a.shape[0], device=a.device)  # (n,)
    loss = triplet.compute(cosine_matrix(a, b), diagonal, epoch=epoch).loss  # (n, n) cosines
    if nce_weight > 0:
        loss = loss + nce_weight * infonce(a @ b.t(), diagonal)  # (n, n) dots
    return loss
