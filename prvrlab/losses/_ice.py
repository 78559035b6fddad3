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


def distinct_targets(target: Tensor) -> tuple[Tensor, Tensor]:
    """(n, D) targets -> their k distinct rows (k, D), in order of first appearance, and each pair's row
    among them (n,); ``target`` itself and ``arange(n)`` when every row differs.  Rows are the same when
    they are bit for bit: IRM's r_v(i) = FC(v - m_k(i)) of two queries of one video with one key moment."""
    n = target.shape[0]
    column = torch.arange(n, device=target.device)  # (n,)
    if n < 2:
        return target, column
    _, group = torch.unique(target.detach(), dim=0, return_inverse=True)  # (n,) sorted-row ids
    k = int(group.max()) + 1
    if k == n:
        return target, column
    first = torch.full((k,), n, dtype=torch.long, device=target.device).scatter_reduce(0, group, column, reduce="amin")
    order = first.argsort()  # (k,) groups by first appearance
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(k, device=target.device))  # (k,)
    return target[first[order]], rank[group]


def paired_contrastive(
    anchor: Tensor,
    target: Tensor,
    triplet: TripletLoss,
    nce_weight: float,
    *,
    epoch: int,
    anchor_group: Tensor | None = None,
    target_group: Tensor | None = None,
) -> Tensor:
    """L^trip + nce_weight * L^nce of n aligned pairs (anchor_i, target_i), (n, D) each.

    The matrix has anchors as rows ("queries") and targets as columns
    ("videos"), each pair's target its positive: the triplet loss on cosines
    (both directions, :class:`TripletLoss`) and InfoNCE on raw dot products
    (both directions, :func:`infonce`), as the base model's L^trip / L^nce.
    Identical targets are one column, positive for each of their anchors
    (:func:`distinct_targets`): as separate columns each would be the
    other's negative while equal to its positive.  Distinct targets: the
    n x n matrix, the diagonal positive.  With ``anchor_group`` and
    ``target_group`` (n,) each, an anchor and another pair's target of the
    same group are neither positive nor negative (left out of both terms).
    """
    a = anchor.float()
    b, column = distinct_targets(target.float())  # (k, D), (n,)
    ignore = None
    if anchor_group is not None and target_group is not None:
        column_group = target_group.new_empty(b.shape[0]).scatter_(0, column, target_group)  # (k,) a member's group
        ignore = anchor_group[:, None] == column_group[None, :]  # (n, k); the losses never ignore a positive
    loss = triplet.compute(cosine_matrix(a, b), column, epoch=epoch, ignore=ignore).loss  # (n, k) cosines
    if nce_weight > 0:
        loss = loss + nce_weight * infonce(a @ b.t(), column, ignore=ignore)  # (n, k) dots
    return loss
