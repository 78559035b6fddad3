"""The global batch on every DDP rank (``train.ddp_batch: global``).

Each rank encodes its share of a step's videos and queries; the encodings are then gathered, so every rank
scores every query of the global batch against every video of it and computes the same loss as one process
holding the whole batch: in-batch negatives, hardest-negative pools, softmax columns and per-query means
span the global batch.  The gather keeps the gradient of each rank's own rows: the gathered rows' gradients
are summed over the ranks in the backward pass (every rank's loss reads every row), which DDP's average
over the ranks turns into the one-process gradient.

Rows are concatenated in rank order (the order :class:`~prvrlab.data.sampler.VideoBatchSampler` deals a
global batch out in); each tensor's later dimensions (frames, words) are zero/False-padded to the longest
over the ranks.  The raw features are not gathered: the global :class:`~prvrlab.data.batch.Batch` holds
the gathered masks, ``query_video`` and ids, and feature tensors with no feature dimension.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from prvrlab.data.batch import Batch, tag_lengths
from prvrlab.models.base import BatchEncoding, _map_tensors, tensors_of

def gather_rows(local: Tensor, rows: list[int], group: Any = None) -> Tensor:
    """Every rank's first ``rows[r]`` rows of its ``local`` (all padded to one shape), concatenated in rank order
    (``group``: the process group, default the whole world)."""
    parts = [torch.empty_like(local) for _ in rows]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat([part[:n] for part, n in zip(parts, rows)])  # (sum(rows), ...)


class _GatherRows(torch.autograd.Function):
    """:func:`gather_rows` with a gradient: the gradient of this rank's rows summed over ranks."""

    @staticmethod
    def forward(ctx, local: Tensor, rows: list[int], rank: int) -> Tensor:  # local: (n_max, ...) padded rows
        ctx.rows, ctx.rank, ctx.padded = rows, rank, local.shape[0]
        return gather_rows(local, rows)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.clone(memory_format=torch.contiguous_format)  # autograd may hand the same buffer to another input
        dist.all_reduce(grad)  # every rank's loss reads every row
        start = sum(ctx.rows[: ctx.rank])
        own = grad[start : start + ctx.rows[ctx.rank]]  # (n_rank, ...)
        return F.pad(own, (0, 0) * (own.dim() - 1) + (0, ctx.padded - own.shape[0])), None, None


class _Gatherer:
    """Gathers the tensors of one step in one order on every rank; ``shapes[r]``: rank r's shapes of them, in
    that order (exchanged with the host values, so the tensors need no exchange of their own)."""

    def __init__(self, shapes: list[list[tuple[int, ...]]]) -> None:
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        if len({len(s) for s in shapes}) != 1:
            raise RuntimeError(f"the DDP ranks hold different numbers of tensors to gather: {[len(s) for s in shapes]}")
        self.shapes, self.next = shapes, 0

    def __call__(self, t: Tensor) -> Tensor:
        shapes = [rank_shapes[self.next] for rank_shapes in self.shapes]  # this tensor's shape on every rank
        self.next += 1
        if len({len(shape) for shape in shapes}) != 1:
            raise RuntimeError(f"the DDP ranks gather tensors of different ranks: {shapes}")
        longest = [max(sizes) for sizes in zip(*shapes)]  # the padded shape, rows included
        pad: list[int] = []
        for dim in reversed(range(t.dim())):
            pad += [0, longest[dim] - t.shape[dim]]
        padded = F.pad(t, pad) if any(pad) else t  # zeros; False for a bool mask
        rows = [shape[0] for shape in shapes]
        return _GatherRows.apply(padded, rows, self.rank) if t.requires_grad else gather_rows(padded, rows)


def _host_part(batch: Batch, tensors: list[Tensor]) -> dict[str, Any]:
    """What the global batch needs from this rank's share on the host, and the shapes of ``tensors``."""
    return {
        "shapes": [tuple(t.shape) for t in tensors],
        "videos": batch.num_videos,
        "video_ids": list(batch.video_ids),
        "query_ids": list(batch.query_ids),
        "query_video": batch.host_query_video(),
        "frame_lengths": batch.frame_lengths_host,
        "query_lengths": batch.query_lengths_host,
    }


def _joined(parts: list[np.ndarray | None]) -> np.ndarray | None:
    return None if any(p is None for p in parts) else np.concatenate(parts).astype(np.int64)


def gather_batch(encoding: BatchEncoding, batch: Batch) -> tuple[BatchEncoding, Batch]:
    """The global batch's encodings and :class:`Batch` on every rank, from each rank's ``encoding`` of its
    share ``batch`` (a collective: every rank calls it once per step, in the same place)."""
    hosts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, _host_part(batch, tensors_of(encoding) + [batch.frame_mask, batch.query_mask]))
    gather = _Gatherer([h["shapes"] for h in hosts])
    gathered = _map_tensors(encoding, gather)
    frame_mask, query_mask = gather(batch.frame_mask), gather(batch.query_mask)  # (B, Lf), (Nq, Lq)
    offsets = np.cumsum([0] + [h["videos"] for h in hosts[:-1]])
    query_video_host = np.concatenate([h["query_video"] + off for h, off in zip(hosts, offsets)]).astype(np.int64)
    for mask, key in ((frame_mask, "frame_lengths"), (query_mask, "query_lengths")):
        lengths = _joined([h[key] for h in hosts])
        if lengths is not None:
            tag_lengths(mask, lengths)
    device = batch.query_video.device
    whole = Batch(
        frames=batch.frames.new_empty((frame_mask.shape[0], frame_mask.shape[1], 0)),  # (B, Lf, 0): not gathered
        frame_mask=frame_mask,
        clips=batch.clips.new_empty((frame_mask.shape[0], batch.clips.shape[1], 0)),  # (B, Lc, 0)
        queries=batch.queries.new_empty((query_mask.shape[0], query_mask.shape[1], 0)),  # (Nq, Lq, 0)
        query_mask=query_mask,
        query_video=torch.from_numpy(query_video_host).to(device, non_blocking=True),
        video_ids=[v for h in hosts for v in h["video_ids"]],
        query_ids=[q for h in hosts for q in h["query_ids"]],
        query_video_host=query_video_host,
    )
    return gathered, whole
