"""Gaussian-constrained attention (GMMFormer) and the plain transformer layer.

A Gaussian branch with width sigma multiplies the scaled attention logits by a
window over normalised relative position: with ``w = max(sigma, 0.01) / 9``::

    G(i, j) = exp(-d(i, j)^2 / (2 w^2))

over a span of ``n`` positions, where ``window`` picks the offset

* ``official`` (the reference code, ``generate_gauss_weight``):
  ``d = j / (n - 1) - i / n``; rows sit at ``i / n``, columns at
  ``j / (n - 1)``, so rows past the middle peak at column ``i - 1``, and
  each row is divided by its largest value (most rows have no column at
  ``d = 0``: with n = 32 and sigma 0.1 the middle row's peak was 0.35);
* ``official_raw``: the same offsets, rows not divided by their maximum
  (prvrlab before checkpoint format 8);
* ``centred``: ``d = (j - i) / (n - 1)``, 1 on the diagonal;

and ``window_length`` picks the span ``n``: ``padded``, the input's padded
length (the reference; for frames, the batch's longest video: a backbone may
pass a fixed int, ``max_frames``, instead, so the window never depends on the
batch, see :func:`video_window_spans`), an int, that fixed span,
or ``real``, each sequence's real length (padding never changes the
window).  ``sigma = inf`` gives the all-ones window, i.e. plain attention.

Fast paths (``GaussianAttention.fast``, on by default; the plain path is kept
for the exactness tests).  The window multiplies the *logits*:
``softmax(G * S)`` with ``S = Q K^T / sqrt(d_h)``.  An additive bias
``log G`` (what ``scaled_dot_product_attention``'s ``attn_mask`` adds) gives
``softmax(S + log G) = G * exp(S) / sum(G * exp(S))``, which re-weights the
*probabilities* instead: a different function (equal only where ``G = 1``).
``G * S`` is not a product ``Q' K'^T`` either (``G`` is not of low rank for
finite widths), so no fused kernel computes a finite-width branch exactly.
Hence:

* branches with ``sigma = inf`` (``G = 1``) run on
  ``torch.nn.functional.scaled_dot_product_attention`` with the padding-key
  bias as its additive ``attn_mask`` (exact) except where the explicit pass
  was measured faster (``_one_pass``): on a CPU with the fused weights
  below, always; without them, autograd in bf16 on a CPU with native bf16
  units (SDPA's CPU backward costs more than the explicit pass) and mixed
  branches in float32 (splitting them and gathering their gradients cost
  more than the fused kernel saves);
* finite-width branches keep the explicit product, softmax and product;
  under bf16/fp16 autocast on a CPU without native bf16 matrix units
  (AVX512-BF16 / AMX) their (L, L) products run in float32, where the
  emulated bf16 batched GEMM is tens of times slower than float32.  On a
  CPU, between the two products, window, key mask, softmax and dropout run
  as one fused kernel forward and one backward
  (:mod:`prvrlab.models.window_softmax`: each (L, L) element read and
  written once instead of in seven PyTorch passes, padded query rows
  skipped; the same dropout draw as the plain path).

On a CPU with the fused weights, a padded batch of videos of varied lengths is attended in up to
``GaussianAttention.max_buckets`` length buckets (:func:`length_buckets`: equal video counts by length,
each padded to its longest video), so the (L, L) products and weights skip most of the padding: at
uniform 24-128 frames four buckets do 60% of the work; v2's step on an AMX CPU, 128 videos, alternating:
float32 6.20 -> 5.55 s, bf16 2.08 -> 2.01 s (best of five).  Exact: padded keys weigh 0, padded query
rows are never read, and a bucket's windows are the first L_b positions of the batch's
(:func:`gaussian_window`'s ``span``).  Not with attention dropout (its draw is the whole batch's).

With attention dropout active in training, every branch takes the explicit
pass, never SDPA (its random mask must stay the plain path's; the fused
weights apply the same draw).  At inference, a
batch that is mostly real tokens (evaluation's by-length batches) projects
Q/K/V on the padded layout (:meth:`~prvrlab.models.blocks.Packing.padded_first`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import ClassVar, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from prvrlab.checks import check_bool, check_choice, check_positive_int
from prvrlab.models import row_chunks, window_softmax
from prvrlab.models.blocks import (
    BranchLinear,
    Dropout,
    PackedLayer,
    Packing,
    dropout_draw,
    mask_from_draw,
    project,
    relu_ffn,
    residual_dropout_draw,
    resolve_ffn_size,
)
from prvrlab.models.layer_norm import LayerNorm, layer_norm
from prvrlab.models.precision import native_low_precision

DEFAULT_SIGMAS: tuple[float, ...] = (0.5, 1.0, 5.0, math.inf)
Window = Literal["official", "centred", "official_raw"]
WINDOWS: tuple[str, ...] = ("official", "centred", "official_raw")
MIN_SIGMA = 1e-2  # the reference clamps every width to at least this before dividing by 9
WindowLength = Literal["real", "padded"] | int
FfnActivation = Literal["gelu", "relu"]
FFN_ACTIVATIONS: tuple[str, ...] = ("gelu", "relu")


def ffn_inner(activation: FfnActivation, dropout: float = 0.0) -> nn.Module:
    """The parameter-free middle of a ``Linear -> activation [-> Dropout] -> Linear`` FFN, one module so the
    FFN's Linear layers keep their ``0`` / ``2`` indices (and checkpoint keys) with or without the dropout."""
    act = nn.GELU() if check_choice(activation, "ffn_activation", FFN_ACTIVATIONS) == "gelu" else nn.ReLU()
    return nn.Sequential(act, Dropout(dropout)) if dropout > 0 else act


def check_window(window: str, window_length: WindowLength) -> None:
    """Raise ValueError on an unknown ``window`` or a ``window_length`` not real / padded / a positive int."""
    if window not in WINDOWS:
        raise ValueError(f"window must be one of {', '.join(WINDOWS)}, got {window!r}")
    if window_length not in ("real", "padded"):
        check_positive_int(window_length, "window_length")


VideoWindowLength = Literal["padded", "batch", "real"]
VIDEO_WINDOW_LENGTHS: tuple[str, ...] = ("padded", "batch", "real")


def video_window_spans(window: str, window_length: str, max_frames: int) -> tuple[WindowLength, WindowLength]:
    """The (clip, frame) GMMBlock spans of a clip-and-frame backbone's ``window_length``: ``padded``, the
    clip count and ``max_frames`` (a video's encoding never depends on its batch); ``batch``, the clip
    count and the frames' padded length, which is the batch's longest video (the reference code, whose
    collate functions pad each batch to its longest video); ``real``, each video's real length."""
    check_window(window, "real")
    if window_length not in VIDEO_WINDOW_LENGTHS:
        raise ValueError(f"window_length must be one of {', '.join(VIDEO_WINDOW_LENGTHS)}, got {window_length!r}")
    spans: dict[str, tuple[WindowLength, WindowLength]] = {
        "padded": ("padded", max_frames), "batch": ("padded", "padded"), "real": ("real", "real"),
    }
    return spans[window_length]


def parse_sigmas(values: Sequence[float | str], name: str = "sigmas") -> tuple[float, ...]:
    """Window widths as floats: positive numbers, ``inf`` or the string ``"inf"``."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or len(values) == 0:
        raise ValueError(f"{name} must be a non-empty list of positive numbers or 'inf', got {values!r}")
    out = []
    for i, value in enumerate(values):
        sigma = math.nan
        if isinstance(value, str):
            try:
                sigma = float(value)
            except ValueError:
                pass
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            sigma = float(value)
        if not sigma > 0:  # also rejects NaN
            raise ValueError(f"{name}[{i}] must be a positive number or 'inf', got {value!r}")
        out.append(sigma)
    return tuple(out)


def _window_from_offsets(offsets: Tensor, sigma: float, window: Window) -> Tensor:
    """exp(-d^2 / (2 (max(sigma, 0.01)/9)^2)) for normalised offsets d (..., L, L), divided by each row's
    largest value where ``window`` is ``official`` (the reference's ``weight / weight.max(dim=-1)``),
    computed as exp(-(d^2 - min_j d^2) / ...), which cannot underflow to 0/0; ones when sigma is inf.
    A row's nearest column lies within its first L columns, so the maximum over the whole span is
    among them."""
    if math.isinf(sigma):
        return torch.ones_like(offsets)
    width = max(sigma, MIN_SIGMA) / 9.0
    squared = offsets * offsets  # (..., L, L)
    if window == "official":
        squared = squared - squared.amin(dim=-1, keepdim=True)
    return torch.exp(-squared / (2.0 * width * width))


def window_offsets(length: int, span: Tensor, window: Window) -> Tensor:
    """Offsets d(i, j) of the first ``length`` positions of spans ``span`` (...,) -> (..., length, length)."""
    steps = torch.arange(length, device=span.device, dtype=torch.float32)
    n = span.to(torch.float32)[..., None, None]  # (..., 1, 1)
    cols = steps[None, :] / (n - 1).clamp(min=1)  # (..., 1, L)
    if window == "centred":
        return cols - steps[:, None] / (n - 1).clamp(min=1)  # (..., L, L)
    return cols - steps[:, None] / n.clamp(min=1)  # (..., L, L) official and official_raw


@functools.lru_cache(maxsize=512)
def _cached_window(length: int, span: int, sigma: float, window: Window, device: torch.device) -> Tensor:
    with torch.inference_mode(False), torch.no_grad():
        offsets = window_offsets(length, torch.full((), span, device=device), window)  # (L, L); a fill, no host copy
        return _window_from_offsets(offsets, sigma, window)


def gaussian_window(
    length: int,
    sigma: float,
    *,
    window: Window = "official",
    span: int | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """The (length, length) window of the first ``length`` positions of a span (default: ``length``)
    (cached; do not modify)."""
    check_positive_int(length, "length")
    span = length if span is None else check_positive_int(span, "span")
    if span < length:
        raise ValueError(f"span={span} is shorter than length={length}")
    check_window(window, "real")
    (sigma,) = parse_sigmas([sigma], "sigma")
    return _cached_window(length, span, sigma, window, torch.device(device or "cpu"))


@functools.lru_cache(maxsize=512)
def _cached_stack(
    length: int,
    span: int,
    sigmas: tuple[float, ...],
    window: Window,
    scale: float,
    dtype: torch.dtype,
    device: torch.device,
) -> Tensor:
    with torch.inference_mode(False), torch.no_grad():
        stack = torch.stack([_cached_window(length, span, s, window, device) for s in sigmas])  # (K, L, L)
        return (stack * scale).to(dtype)[None, :, None]  # (1, K, 1, L, L)


def batched_windows(lengths: Tensor, length: int, sigmas: Sequence[float], window: Window = "official") -> Tensor:
    """(B, K, L, L) windows of sequences spanning their real ``lengths`` (B,), padded to ``length``."""
    offsets = window_offsets(length, lengths.clamp(min=1), window)  # (B, L, L)
    return torch.stack([_window_from_offsets(offsets, s, window) for s in sigmas], dim=1)  # (B, K, L, L)


class _RowChunks:
    """Element offsets for :func:`~prvrlab.models.row_chunks.move_chunks` between packed rows and a padded
    layout whose token (b, l) of "middle" index m starts at ``(b * row_stride + l) * Dh + mid[m]``.

    ``rows`` / ``positions`` (N,): each packed token's (b, l); the padded tensor holds ``batch`` x
    ``length`` slots; ``padding``: the element offsets of the empty slots' first chunks; ``packed`` (N,):
    the tokens' rows in the packed tensor (default: 0 .. N - 1; a length bucket's tokens are some of them)."""

    def __init__(
        self, rows: Tensor, positions: Tensor, batch: int, length: int, row_stride: int, dh: int, packed: Tensor | None = None
    ) -> None:
        if rows.numel() and not (0 <= int(rows.min()) <= int(rows.max()) < batch and 0 <= int(positions.min()) <= int(positions.max()) < length):
            raise ValueError(f"packed rows outside the ({batch}, {length}) slots of their padded layout")  # the kernel writes there
        self.real = (rows * row_stride + positions) * dh  # (N,)
        filled = torch.zeros(batch * length, dtype=torch.bool)
        filled[rows * length + positions] = True
        empty = (~filled).nonzero().squeeze(1)  # (P,) flat b * length + l
        self.padding = (torch.div(empty, length, rounding_mode="floor") * row_stride + empty % length) * dh  # (P,)
        self.packed = torch.arange(rows.numel()) if packed is None else packed  # (N,) each token's packed row

    @staticmethod
    def usable(rows: Tensor | None, *tensors: Tensor) -> bool:
        """Whether the kernel takes this move: padded rows given, every tensor contiguous on CPU."""
        return rows is not None and rows.device.type == "cpu" and row_chunks.usable(*tensors)


def _grid(*strides: tuple[int, int]) -> Tensor:
    """Offsets ``sum_i index_i * stride_i`` over the (count, stride) axes, the first axis outermost: (prod counts,)."""
    out = torch.zeros(1, dtype=torch.int64)
    for count, stride in strides:
        out = (out[:, None] + torch.arange(count)[None, :] * stride).flatten()
    return out


def _heads_from_rows(projected: Tensor, chunks: _RowChunks, batch: int, length: int) -> Tensor:
    """(3, B, G, L, Dh) heads of the packed rows ``chunks.packed`` of ``projected`` (N, 3, G, Dh), zeros on padding."""
    _, _, G, Dh = projected.shape
    heads = projected.new_empty((3, batch, G, length, Dh))  # (3, B, G, L, Dh)
    dst_mid = _grid((3, batch * G * length * Dh), (G, length * Dh))  # (3G,)
    src_mid = _grid((3 * G, Dh))
    row_chunks.move_chunks(heads, projected, chunks.real, chunks.packed * (3 * G * Dh), dst_mid, src_mid, Dh, chunks.padding)
    return heads


def _rows_from_heads(out: Tensor, grads: Sequence[Tensor], chunks: _RowChunks) -> None:
    """The real rows of the (B, G, L, Dh) q, k, v gradients into rows ``chunks.packed`` of ``out`` (N, 3, G, Dh)."""
    _, G, L, Dh = grads[0].shape
    dst_mid, src_mid = _grid((G, Dh)), _grid((G, L * Dh))
    for j, g in enumerate(grads):
        dst_base = chunks.packed * (3 * G * Dh) + j * G * Dh
        row_chunks.move_chunks(out, g.contiguous(), dst_base, chunks.real, dst_mid, src_mid, Dh)


def _merge_into(out: Tensor, heads: Tensor, chunks: _RowChunks) -> None:
    """Attention outputs ``heads`` (B, k, H, L, Dh) into rows ``chunks.packed`` of ``out`` (k, N, H * Dh)."""
    B, K, H, L, Dh = heads.shape
    N = out.shape[1]
    row_chunks.move_chunks(
        out, heads, chunks.packed * (H * Dh), chunks.real, _grid((K, N * H * Dh), (H, Dh)), _grid((K * H, L * Dh)), Dh
    )


def _unmerge(grad: Tensor, chunks: _RowChunks, shape: tuple[int, ...]) -> Tensor:
    """Rows ``chunks.packed`` of ``grad`` (k, N, H * Dh) as (B, k, H, L, Dh) of ``shape``, zeros on padding."""
    B, K, H, L, Dh = shape
    N = grad.shape[1]
    out = grad.new_empty(shape)  # (B, k, H, L, Dh)
    row_chunks.move_chunks(
        out, grad.contiguous(), chunks.real, chunks.packed * (H * Dh), _grid((K * H, L * Dh)),
        _grid((K, N * H * Dh), (H, Dh)), Dh, chunks.padding,
    )
    return out


@dataclass(frozen=True)
class LengthBucket:
    """Some of a padded batch's videos, attended over their own padded ``length`` (:func:`length_buckets`).

    ``videos`` (b,) their rows in the batch; ``tokens`` (n,) their tokens' rows in the packed layout, with
    ``rows`` / ``positions`` (n,) each token's video in the bucket and position; ``packing`` the bucket's
    own (b, length) packing, its windows spanning the batch's padded length."""

    videos: Tensor
    tokens: Tensor
    rows: Tensor
    positions: Tensor
    packing: Packing

    @property
    def batch(self) -> int:
        return self.packing.batch

    @property
    def length(self) -> int:
        return self.packing.length


LENGTH_STEP = 16  # a bucket's padded length is a multiple of this (few distinct product shapes), at most the batch's
MAX_BUCKET_WORK = 0.85  # bucket only when the attention's (L x L) work falls to at most this share


def length_buckets(packing: Packing, count: int) -> list[LengthBucket] | None:
    """The videos of a padded CPU packing split into at most ``count`` buckets of similar length (equal video
    counts by increasing length), each padded to its longest video rounded up to :data:`LENGTH_STEP`, where
    that cuts the attention's ``sum_b L_b^2`` work to at most :data:`MAX_BUCKET_WORK` of ``B * L^2``; None
    otherwise (nothing padded, a grid's key mask, tokens not each video's first positions in row order, or
    not worth it).  Attention within a bucket is the batch's attention for its videos: padded keys weigh
    0, padded query rows are never read, and a bucket's windows are the top-left block of the batch's
    (:func:`gaussian_window`'s ``span``)."""
    if count < 2 or packing.index is None or packing.keys is not None or packing.lengths.device.type != "cpu":
        return None
    B, L = packing.batch, packing.length
    lengths = packing.lengths.numpy().astype(np.int64)  # (B,)
    starts = np.cumsum(lengths) - lengths  # (B,) each video's first packed row
    expected = np.arange(int(lengths.sum())) - np.repeat(starts, lengths)  # (N,) prefix positions in row order
    flat = np.repeat(np.arange(B) * L, lengths) + expected  # (N,) each token's b * L + t, rows in order
    if packing.positions.numel() != expected.size or not (
        np.array_equal(packing.positions.numpy(), expected) and np.array_equal(packing.index.cpu().numpy(), flat)
    ):
        return None
    groups = [np.sort(g) for g in np.array_split(np.argsort(lengths, kind="stable"), min(count, B)) if g.size]
    spans = [min(L, -(-int(lengths[g].max()) // LENGTH_STEP) * LENGTH_STEP) for g in groups]
    if sum(g.size * span * span for g, span in zip(groups, spans)) > MAX_BUCKET_WORK * B * L * L:
        return None
    buckets = []
    for videos, span in zip(groups, spans):
        lens = lengths[videos]  # (b,)
        if span == 0 or lens.sum() == 0:
            continue  # no tokens
        local = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)  # (n,) positions
        tokens = np.repeat(starts[videos], lens) + local  # (n,) packed rows
        inner = Packing.from_lengths(lens, span, "cpu")
        buckets.append(LengthBucket(
            videos=torch.from_numpy(videos), tokens=torch.from_numpy(tokens), rows=torch.from_numpy(np.repeat(np.arange(videos.size), lens)),
            positions=torch.from_numpy(local), packing=replace(inner, window_span=packing.window_span or L),
        ))
    return buckets or None  # None: no tokens at all


class _BucketHeads(torch.autograd.Function):
    """:class:`_HeadLayout` for length buckets: packed Q/K/V rows (N, 3, G, Dh) -> each bucket's q, k, v, each
    (b, G, L_b, Dh) contiguous, zeros on padding; the backward writes one (N, 3, G, Dh) gradient, each token's
    rows from its bucket's (the buckets partition the tokens)."""

    @staticmethod
    def forward(ctx, projected: Tensor, buckets: list[LengthBucket]):
        N, _, G, Dh = projected.shape
        if sum(b.tokens.numel() for b in buckets) != N:
            raise ValueError(f"length buckets of {sum(b.tokens.numel() for b in buckets)} tokens for {N} projected rows")
        ctx.layouts = [_RowChunks(b.rows, b.positions, b.batch, b.length, G * b.length, Dh, b.tokens) for b in buckets]
        ctx.n = N
        out = []
        for bucket, chunks in zip(buckets, ctx.layouts):
            heads = _heads_from_rows(projected, chunks, bucket.batch, bucket.length)  # (3, b, G, L_b, Dh)
            out += [heads[0], heads[1], heads[2]]
        return tuple(out)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads: Tensor):
        _, G, _, Dh = grads[0].shape
        out = grads[0].new_empty((ctx.n, 3, G, Dh))  # (N, 3, G, Dh): every row written by its bucket
        for i, chunks in enumerate(ctx.layouts):
            _rows_from_heads(out, grads[3 * i : 3 * i + 3], chunks)
        return out, None


class _BucketMerge(torch.autograd.Function):
    """:class:`_MergeHeads` for length buckets: each bucket's attention outputs (b, k, H, L_b, Dh) -> one
    (k, N, H * Dh) packed output."""

    @staticmethod
    def forward(ctx, buckets: list[LengthBucket], n: int, *heads: Tensor) -> Tensor:
        _, K, H, _, Dh = heads[0].shape
        ctx.layouts = [_RowChunks(b.rows, b.positions, b.batch, b.length, K * H * b.length, Dh, b.tokens) for b in buckets]
        ctx.shapes = [tuple(h.shape) for h in heads]
        out = heads[0].new_empty((K, n, H * Dh))  # (k, N, D): every row written by its bucket
        for h, chunks in zip(heads, ctx.layouts):
            _merge_into(out, h.contiguous(), chunks)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        return (None, None, *(_unmerge(grad, chunks, shape) for chunks, shape in zip(ctx.layouts, ctx.shapes)))


class _HeadLayout(torch.autograd.Function):
    """Packed Q/K/V rows (N, 3, G, Dh) -> ``q, k, v``, each (B, G, L, Dh) contiguous, zeros on padding.

    One scatter into a (3, B, G, L, Dh) buffer, where unpacking to (B, L, 3, G, Dh) and permuting
    made two more passes and each product copied its non-contiguous operand again; the backward
    gathers each gradient's real rows back (the autograd of unpack + unbind + permute stacked the
    three strided gradients first).  ``rows`` / ``positions`` (N,): each token's row and position,
    None when nothing is padded.  Attention forward + backward over 128 videos of 24-128 frames on an
    AMX CPU, old layout vs this one: v2's 8 widths 1.48 -> 1.38 s in bf16 (3.49 -> 3.23 s in fp32),
    GMMFormer's 4 widths 0.66 -> 0.51 s (1.61 -> 1.49 s).  On CPU with the row-chunk kernel
    (:mod:`~prvrlab.models.row_chunks`) each slot is written once, copied or zeroed, and the backward
    gathers straight into its (N, 3, G, Dh) output; elsewhere PyTorch's zero fill, scatter and gathers."""

    @staticmethod
    def forward(ctx, projected: Tensor, rows: Tensor | None, positions: Tensor | None, batch: int, length: int):
        N, _, G, Dh = projected.shape
        expected = batch * length if rows is None else rows.numel()
        if N != expected:
            raise ValueError(f"{N} projected tokens for a packing of {expected}")
        shape = (3, batch, G, length, Dh)
        ctx.full = rows is None
        ctx.chunks = None
        if _RowChunks.usable(rows, projected):
            ctx.chunks = chunks = _RowChunks(rows, positions, batch, length, G * length, Dh)
            heads = _heads_from_rows(projected, chunks, batch, length)  # (3, B, G, L, Dh)
            return heads[0], heads[1], heads[2]
        heads = projected.new_empty(shape) if rows is None else projected.new_zeros(shape)  # (3, B, G, L, Dh)
        slots = heads.permute(1, 3, 0, 2, 4)  # (B, L, 3, G, Dh) view
        if rows is None:
            slots.copy_(projected.view(batch, length, 3, G, Dh))
        else:
            slots[rows, positions] = projected
            ctx.save_for_backward(rows, positions)
        return heads[0], heads[1], heads[2]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads: Tensor):
        # (B, G, L, Dh) each; autograd passes zeros for an unused output (materialized gradients)
        B, G, L, Dh = grads[0].shape
        if ctx.full:
            out = torch.stack([g.permute(0, 2, 1, 3) for g in grads], dim=2).view(B * L, 3, G, Dh)  # one pass
        elif ctx.chunks is not None:
            out = grads[0].new_empty((ctx.chunks.packed.numel(), 3, G, Dh))  # (N, 3, G, Dh)
            _rows_from_heads(out, grads, ctx.chunks)
        else:
            rows, positions = ctx.saved_tensors
            out = torch.stack([g.permute(0, 2, 1, 3)[rows, positions] for g in grads], dim=1)  # (N, 3, G, Dh)
        return out, None, None, None, None


class _Scores(torch.autograd.Function):
    """``q @ kᵀ`` of (..., L, Dh) heads -> (..., L, L), whose backward gives ``dk = dSᵀ q`` contiguous, as
    ``dq = dS k`` is: autograd's ``matmul(q, k.transpose(-1, -2))`` gives ``(qᵀ dS)ᵀ``, a transposed view
    that :class:`_HeadLayout`'s backward copied whole before its gather (v2's (128, 32, 128, 96) bf16 keys:
    16.5 ms a step).  The same products (each element the same sum of the same terms, in the GEMM's own
    order), both operands in one dtype, as the fused path has them."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor) -> Tensor:
        ctx.save_for_backward(q, k)
        return torch.matmul(q, k.transpose(-1, -2))  # (..., L, L)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        q, k = ctx.saved_tensors
        need_q, need_k = ctx.needs_input_grad
        g = g.to(q.dtype)
        dq = torch.matmul(g, k) if need_q else None  # (..., L, Dh)
        dk = torch.matmul(g.transpose(-1, -2), q) if need_k else None  # (..., L, Dh) contiguous
        return dq, dk


class _MergeHeads(torch.autograd.Function):
    """Attention outputs (B, k, H, L, Dh) -> (k, N, H * Dh) packed rows: :class:`_HeadLayout` the other way.

    One gather of the real rows, where a permute + reshape copied every slot, padding included, and
    ``index_select`` gathered the real rows again; the backward scatters the gradient's rows into a
    zeroed contiguous (B, k, H, L, Dh), the layout of the products' backward, where autograd zero-filled
    a padded (k, B * L, D) gradient, added the rows into it and copied it to that layout.  ``rows`` /
    ``positions`` (N,): each token's row and position, None when nothing is padded.  v2's 8 widths over
    128 videos of 24-128 frames, forward + backward with dropout 0.1, this and the per-branch output
    projection (:class:`~prvrlab.models.blocks.BranchLinear`) against the layout before, 12 alternating
    pairs on a noisy AMX CPU: 1.04x in bf16 (median of the pairs' ratios), 1.00x in fp32.  On CPU with
    the row-chunk kernel, the gather and the scatter (each slot written once) are one pass each."""

    @staticmethod
    def forward(ctx, heads: Tensor, rows: Tensor | None, positions: Tensor | None) -> Tensor:
        B, K, H, L, Dh = heads.shape
        slots = heads.permute(1, 0, 3, 2, 4)  # (k, B, L, H, Dh) view
        ctx.shape = heads.shape
        ctx.chunks = None
        if rows is None:
            return slots.reshape(K, B * L, H * Dh)
        if _RowChunks.usable(rows, heads):
            ctx.chunks = chunks = _RowChunks(rows, positions, B, L, K * H * L, Dh)
            out = heads.new_empty((K, rows.numel(), H * Dh))  # (k, N, D)
            _merge_into(out, heads, chunks)
            return out
        ctx.save_for_backward(rows, positions)
        return slots[:, rows, positions].view(K, -1, H * Dh)  # (k, N, D)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        # grad (k, N, D)
        B, K, H, L, Dh = ctx.shape
        if ctx.chunks is not None:
            return _unmerge(grad, ctx.chunks, ctx.shape), None, None
        saved = ctx.saved_tensors  # read once (activation checkpointing unpacks each saved tensor once)
        if not saved:
            out = grad.new_empty(ctx.shape)  # (B, k, H, L, Dh)
            out.permute(1, 0, 3, 2, 4).copy_(grad.view(K, B, L, H, Dh))
            return out, None, None
        rows, positions = saved
        out = grad.new_zeros(ctx.shape)  # (B, k, H, L, Dh)
        out.permute(1, 0, 3, 2, 4)[:, rows, positions] = grad.view(K, -1, H, Dh)
        return out, None, None


def _branches(tensors: Sequence[Tensor], index: list[int]) -> list[Tensor]:
    """The branches ``index`` (dim 1) of each tensor: a view when they are a contiguous range."""
    if index == list(range(index[0], index[-1] + 1)):
        return [t[:, index[0] : index[-1] + 1] for t in tensors]
    idx = torch.tensor(index, device=tensors[0].device)
    return [t.index_select(1, idx) for t in tensors]


def _one_pass(q: Tensor, *, mixed: bool) -> bool:
    """Whether plain (sigma = inf) branches run in the explicit pass instead of SDPA (measured on an AMX
    CPU, forward + backward unless said; alternating runs):

    - on a CPU where the fused weights (:mod:`prvrlab.models.window_softmax`) run in ``q``'s dtype
      (float32, or bf16 on native units): always.  Plain-only, 640 queries x 30 tokens: float32
      0.27 vs 0.27 s (SDPA), inference 0.10 vs 0.11 s, bf16 0.15 vs 0.33 s, inference 0.059 vs
      0.067 s; v2's 8 widths over 128 videos: float32 2.41 vs 2.78 s, bf16 1.08 vs 1.48 s, inference
      0.42 vs 0.49 s; GMMFormer's 4 widths from evaluation's strided layout 0.28 vs 0.28 s;
    - without them: float32 when plain and windowed branches mix (splitting them and gathering their
      gradients cost more than SDPA saves); low precision on a CPU with native bf16 units with
      autograd (SDPA's CPU backward is the slow part), and at inference when they mix and ``q`` is
      the contiguous head layout (:class:`_HeadLayout`);
    - else (other devices, emulated bf16): SDPA.
    """
    native = q.device.type == "cpu" and (q.dtype == torch.float32 or native_low_precision("cpu"))
    if native and GaussianAttention.fused and window_softmax.load() is not None:
        return True
    if q.dtype == torch.float32:
        return mixed
    if q.device.type != "cpu" or not native_low_precision("cpu"):
        return False
    return torch.is_grad_enabled() or (mixed and q.is_contiguous())


class GaussianAttention(nn.Module):
    """K parallel multi-head self-attention branches, one Gaussian window each.

    Branch k computes ``a_k = softmax(G_k * Q_k K_k^T / sqrt(d_h)) V_k`` per head
    (padding keys masked) and returns ``W_o,k a_k + b_o,k``; the output holds
    every branch, (K, N, D).  The Q/K/V projections of all branches are one
    Linear(D, 3*K*D) whose output features are laid out ``[Q | K | V]``, each
    as (K branches, H heads, d_h); the output projections are one
    :class:`BranchLinear` (one batched GEMM).  ``out_projection=False``: no
    output projection, the branch returns the merged heads ``a_k`` themselves
    (GMMFormer v2's reference ``BertAttention``, whose ``BertSelfAttention``
    ends with the heads; no ``out`` parameters; every path below unchanged,
    the merge is their last step).  ``dropout`` applies to the
    attention probabilities.  ``window`` / ``window_length``: the Gaussian
    windows (module docstring).  Logits and softmax run in the projections'
    dtype (bf16 under autocast; the softmax kernel accumulates in fp32),
    except the float32 fallback of the module docstring.
    ``fast``: the fast paths of the module docstring (a class switch; the
    exactness tests turn it off to get the plain path); ``fused``: within
    them, the fused CPU kernel for the weights (a class switch for
    benchmarks/bench_model_step.py's same-run comparison).
    """

    fast: ClassVar[bool] = True
    fused: ClassVar[bool] = True
    max_buckets: ClassVar[int] = 4  # fast CPU path: attention over up to this many length buckets (1: none)

    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int = 4,
        sigmas: Sequence[float | str] = DEFAULT_SIGMAS,
        dropout: float = 0.0,
        window: Window = "official",
        window_length: WindowLength = "padded",
        out_projection: bool = True,
    ) -> None:
        super().__init__()
        check_positive_int(hidden_size, "hidden_size")
        check_window(window, window_length)
        check_bool(out_projection, "out_projection")
        check_positive_int(num_heads, "num_heads")
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size={hidden_size} must be divisible by num_heads={num_heads}")
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.sigmas = parse_sigmas(sigmas)
        self.num_branches = len(self.sigmas)
        self.plain = all(math.isinf(s) for s in self.sigmas)
        self.window, self.window_length = window, window_length
        self.qkv = nn.Linear(hidden_size, 3 * self.num_branches * hidden_size)
        # rows [Q | K | V], each branch-major: the reference's 3 x K separate (D, D) projections (per-tensor clipping)
        self.clip_parts = {"qkv.weight": 3 * self.num_branches, "qkv.bias": 3 * self.num_branches}
        self.out: BranchLinear | None = None
        if out_projection:
            self.out = BranchLinear(num_branches=self.num_branches, in_dim=hidden_size, out_dim=hidden_size)
        self.attn_dropout = Dropout(dropout, name="attention_dropout")

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """(B, L, D) with (B, L) mask -> (K, B, L, D), zeros on padding."""
        packing = Packing.from_mask(mask, x.shape[0], x.shape[1], x.device)
        out = self.forward_packed(packing.pack(x), packing)  # (K, N, D)
        return torch.stack([packing.unpack(branch) for branch in out])  # (K, B, L, D)

    def _logit_scale(self, packing: Packing, dtype: torch.dtype, sigmas: tuple[float, ...]) -> Tensor | float:
        """1/sqrt(d_h) times the windows of ``sigmas`` (k of them): a float, (1, k, 1, L, L) or (B, k, 1, L, L)."""
        scale = 1.0 / math.sqrt(self.head_dim)
        if all(math.isinf(s) for s in sigmas):
            return scale
        L, device = packing.length, packing.lengths.device
        if self.window_length == "real" and not packing.is_full:
            windows = batched_windows(packing.lengths, L, sigmas, self.window)  # (B, k, L, L)
            return windows.mul_(scale).to(dtype).unsqueeze(2)  # (B, k, 1, L, L)
        if self.window_length == "padded":
            span = packing.window_span or L  # a length bucket's windows: the first L positions of its batch's span
        else:
            span = L if self.window_length == "real" else self.window_length
        if L > span:
            raise ValueError(f"sequence length {L} exceeds the Gaussian windows' window_length={span}")
        return _cached_stack(L, span, sigmas, self.window, scale, dtype, device)  # (1, k, 1, L, L)

    @staticmethod
    def _key_bias(packing: Packing, dtype: torch.dtype) -> Tensor:
        """(B, L): 0 on the keys attention may look at, a huge negative on the others (padding)."""
        keys = packing.key_mask
        key_bias = torch.zeros(keys.shape, dtype=dtype, device=keys.device)
        return key_bias.masked_fill_(~keys, torch.finfo(dtype).min / 2)

    def _attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        packing: Packing,
        sigmas: tuple[float, ...],
        draw: Tensor | None = None,
        fused: bool = False,
    ) -> Tensor:
        """The plain path, ``softmax(G * Q K^T / sqrt(d_h) + key bias) V``: (B, k, H, L, Dh) each -> (B, k, H, L, Dh).

        ``draw``: a :func:`~prvrlab.models.blocks.dropout_draw` (B, k, H, L, L) taken beforehand for the
        attention dropout (else it is drawn here).  ``fused``: the weights from the fused CPU kernel
        (:mod:`prvrlab.models.window_softmax`) where it takes the logits."""
        same = q.dtype == k.dtype and (not torch.is_autocast_enabled("cpu") or torch.get_autocast_dtype("cpu") == q.dtype)
        if fused and q.device.type == "cpu" and same:  # autocast would not cast them
            logits = _Scores.apply(q, k)  # (B, k, H, L, L); its key gradient comes out contiguous
        else:
            logits = torch.matmul(q, k.transpose(-1, -2))  # (B, k, H, L, L)
        if fused and window_softmax.usable(logits):
            probs = self._fused_weights(logits, packing, sigmas, draw)
        else:
            probs = self._weights(logits, packing, sigmas, draw)
        return torch.matmul(probs, v)  # (B, k, H, L, Dh)

    def _weights(self, logits: Tensor, packing: Packing, sigmas: tuple[float, ...], draw: Tensor | None) -> Tensor:
        """The attention weights of (B, k, H, L, L) ``logits``, dropout applied, in PyTorch operations."""
        scale = self._logit_scale(packing, logits.dtype, sigmas)
        if packing.key_mask is None:
            logits = logits.mul_(scale)
        else:  # one pass: window * logits + key bias
            key_bias = self._key_bias(packing, logits.dtype)[:, None, None, None, :]  # (B, 1, 1, 1, L)
            if isinstance(scale, Tensor):
                logits = torch.addcmul(key_bias, logits, scale)
            else:
                logits = key_bias.add(logits, alpha=scale)
        probs = torch.softmax(logits, dim=-1)  # (B, k, H, L, L)
        if draw is not None and self.training:
            return probs * mask_from_draw(draw, self.attn_dropout.p, probs.dtype)
        return self.attn_dropout(probs)

    def _fused_weights(self, logits: Tensor, packing: Packing, sigmas: tuple[float, ...], draw: Tensor | None) -> Tensor:
        """:meth:`_weights` in one fused pass (the same dropout draw; zeros on padded query rows, whose outputs
        are never read): (B, k, H, L, L) -> (B, k, H, L, L)."""
        p = self.attn_dropout.p if self.training else 0.0
        if p > 0 and draw is None:
            draw = dropout_draw(logits.shape, p, logits.device)  # what the plain path's dropout draws
        if p > 0 and (draw.dtype != torch.int16 or not window_softmax.takes(p)):  # not for this kernel
            return self._weights(logits, packing, sigmas, draw)
        window = self._logit_scale(packing, torch.float32, sigmas)  # float, (1, k, 1, L, L) or (B, k, 1, L, L)
        rows = None if packing.index is None else packing.lengths  # a grid keeps its padded rows' outputs
        return window_softmax.WindowSoftmax.apply(logits, window, packing.key_mask, rows, draw if p > 0 else None, p)

    def _attend_windowed(
        self, q: Tensor, k: Tensor, v: Tensor, packing: Packing, sigmas: tuple[float, ...], draw: Tensor | None = None
    ) -> Tensor:
        """:meth:`_attend` with the fused weights, in float32 where the low-precision batched GEMM is emulated
        (module docstring)."""
        device = q.device.type
        if q.dtype not in (torch.bfloat16, torch.float16) or native_low_precision(device):
            return self._attend(q, k, v, packing, sigmas, draw, fused=self.fused)
        with torch.autocast(device, enabled=False):
            return self._attend(q.float(), k.float(), v.float(), packing, sigmas, draw, fused=self.fused)

    def _attend_sdpa(self, q: Tensor, k: Tensor, v: Tensor, packing: Packing) -> Tensor:
        """Plain (sigma = inf) branches on the fused kernel: (B, k, H, L, Dh) each -> (B, k, H, L, Dh)."""
        B, nk, H, L, Dh = q.shape
        q, k, v = (t.reshape(B, nk * H, L, Dh) for t in (q, k, v))  # (B, k*H, L, Dh)
        mask = None if packing.key_mask is None else self._key_bias(packing, q.dtype)[:, None, None, :]  # (B, 1, 1, L)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, k*H, L, Dh)
        return out.view(B, nk, H, L, Dh)

    def _attend_fast(
        self, q: Tensor, k: Tensor, v: Tensor, packing: Packing, sigmas: tuple[float, ...], draw: Tensor | None = None
    ) -> Tensor:
        """The fast paths (module docstring), branch order kept: (B, k, H, L, Dh) each -> (B, k, H, L, Dh)."""
        plain = [i for i, s in enumerate(sigmas) if math.isinf(s)]
        windowed = [i for i, s in enumerate(sigmas) if not math.isinf(s)]
        if self.training and self.attn_dropout.p > 0:  # keep the plain path's dropout mask
            plain, windowed = [], list(range(len(sigmas)))
        if plain and _one_pass(q, mixed=bool(windowed)):  # measured: there SDPA costs more than it saves
            plain, windowed = [], list(range(len(sigmas)))
        parts, order = [], []
        if windowed:
            part_sigmas = tuple(sigmas[i] for i in windowed)
            parts.append(self._attend_windowed(*_branches((q, k, v), windowed), packing, part_sigmas, draw))
            order += windowed
        if plain:
            parts.append(self._attend_sdpa(*_branches((q, k, v), plain), packing))
            order += plain
        ctx = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)  # (B, K, H, L, Dh), branches in `order`
        if order != sorted(order):
            ctx = ctx.index_select(1, torch.tensor(order, device=ctx.device).argsort())
        return ctx

    def forward_packed(
        self, x: Tensor, packing: Packing, branches: slice = slice(None), draw: Tensor | None = None
    ) -> Tensor:
        """(N, D) packed tokens -> (k, N, D), one output per branch of ``branches`` (all by default).

        ``draw``: the attention dropout's draw for these branches, taken beforehand (see :meth:`_attend`);
        with it, a run over slices of the branches equals the run over all of them."""
        B, L = packing.batch, packing.length
        H, Dh = self.num_heads, self.head_dim
        sigmas = self.sigmas[branches]
        K = len(sigmas)
        rows, positions = (None, None) if packing.index is None else (packing.rows(), packing.positions)  # (N,) each
        if K == self.num_branches and self.fast and not self.training and packing.padded_first():  # no 3*K*D unpacking
            qkv = project(self.qkv, packing.unpack(x), 3)  # (B*L, K*D) each: Q, K, V
            heads = (t.view(B, L, K, H, Dh).permute(0, 2, 3, 1, 4) for t in qkv)  # (B, K, H, L, Dh) each, strided
        else:
            if K == self.num_branches:
                projected = project(self.qkv, x)  # (N, 3*K*D)
            else:  # the rows of these branches' Q, K and V
                D, weight, bias = self.hidden_size, self.qkv.weight, self.qkv.bias
                weight = weight.view(3, self.num_branches, D, -1)[:, branches].reshape(3 * K * D, -1)  # (3*k*D, D)
                bias = bias.view(3, self.num_branches, D)[:, branches].reshape(3 * K * D)
                projected = F.linear(x, weight, bias)  # (N, 3*k*D)
            buckets = self._buckets(packing, projected, draw)
            if buckets is not None:  # each bucket over its own padded length (length_buckets)
                merged = self._attend_buckets(projected.view(-1, 3, K * H, Dh), buckets, sigmas)  # (k, N, D)
                return merged if self.out is None else self.out(merged, branches)  # (k, N, D)
            heads = _HeadLayout.apply(projected.view(-1, 3, K * H, Dh), rows, positions, B, L)  # (B, k*H, L, Dh) x 3
        q, k, v = (t.reshape(B, K, H, L, Dh) for t in heads)  # (B, k, H, L, Dh) each
        if self.fast:
            ctx = self._attend_fast(q, k, v, packing, sigmas, draw)
        else:
            ctx = self._attend(q, k, v, packing, sigmas, draw)  # (B, k, H, L, Dh)
        merged = _MergeHeads.apply(ctx, rows, positions)  # (k, N, D)
        return merged if self.out is None else self.out(merged, branches)  # (k, N, D)

    def _buckets(self, packing: Packing, projected: Tensor, draw: Tensor | None) -> list[LengthBucket] | None:
        """The length buckets the fast CPU path attends over (:func:`length_buckets`), or None: only with the
        fused weights and the row-chunk kernel, and without attention dropout (its draw is the whole batch's)."""
        dropout = draw is not None or (self.training and self.attn_dropout.p > 0)
        if not (self.fast and GaussianAttention.fused and GaussianAttention.max_buckets > 1) or dropout:
            return None
        if packing.index is None or not _RowChunks.usable(packing.index, projected) or window_softmax.load() is None:
            return None
        if isinstance(self.window_length, int) and packing.length > self.window_length:
            return None  # the batch's path refuses it (_logit_scale), whatever the buckets' lengths
        return length_buckets(packing, GaussianAttention.max_buckets)

    def _attend_buckets(self, projected: Tensor, buckets: list[LengthBucket], sigmas: tuple[float, ...]) -> Tensor:
        """The fast path's attention per length bucket: (N, 3, k*H, Dh) packed Q/K/V -> (k, N, H * Dh) merged heads."""
        K, H, Dh = len(sigmas), self.num_heads, self.head_dim
        heads = _BucketHeads.apply(projected, buckets)  # (b, k*H, L_b, Dh) x 3 per bucket
        outs = []
        for i, bucket in enumerate(buckets):
            q, k, v = (t.reshape(bucket.batch, K, H, bucket.length, Dh) for t in heads[3 * i : 3 * i + 3])
            outs.append(self._attend_fast(q, k, v, bucket.packing, sigmas))  # (b, k, H, L_b, Dh)
        return _BucketMerge.apply(buckets, projected.shape[0], *outs)


class GMMBlock(PackedLayer):
    """GMMFormer's block: Gaussian attention branches, each closed like a BERT attention layer, averaged.

    ``y_k = LN_k(x + Dropout(GaussianAttention(x)_k))`` and ``y = mean_k y_k``
    (per-branch LayerNorm weights), as the reference code's GMMBlock.
    ``ffn_size`` is the width F of a feed-forward sublayer after it,
    ``y = LN(y + Dropout(Linear(F, D)(GELU(Linear(D, F)(y)))))`` (not in the
    reference code); 0: none (the default); None: 4 * hidden_size (see
    :func:`~prvrlab.models.blocks.resolve_ffn_size`).  ``dropout`` applies to
    the residual branches, ``attention_dropout`` to the attention
    probabilities (off by default: on CPU it costs several passes over the
    (B, K, H, L, L) attention tensor).  ``window`` / ``window_length``: the
    Gaussian windows (module docstring).  ``ffn_activation``: the FFN's
    activation, ``gelu`` (the default) or ``relu``; ``ffn_dropout``: dropout
    (rate ``dropout``) on the activation's output too, inside the FFN, as
    GMMFormer v2's reference ``FeedForward`` (Linear -> ReLU -> Dropout ->
    Linear; the FFN keeps its ``ffn.0`` / ``ffn.2`` keys under both);
    ``out_projection``: the attention's output projection
    (:class:`GaussianAttention`).  The defaults are what every backbone but
    GMMFormer v2 uses.
    """

    norm_parameters: ClassVar[tuple[str, ...]] = ("norm_weight", "norm_bias")  # LayerNorm affines: no weight decay

    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int = 4,
        sigmas: Sequence[float | str] = DEFAULT_SIGMAS,
        dropout: float = 0.1,
        attention_dropout: float = 0.0,
        ffn_size: int | None = 0,
        window: Window = "official",
        window_length: WindowLength = "padded",
        ffn_activation: FfnActivation = "gelu",
        ffn_dropout: bool = False,
        out_projection: bool = True,
    ) -> None:
        super().__init__()
        ffn_size = resolve_ffn_size(ffn_size, hidden_size)
        check_choice(ffn_activation, "ffn_activation", FFN_ACTIVATIONS)
        check_bool(ffn_dropout, "ffn_dropout")
        self.attention = GaussianAttention(
            hidden_size=hidden_size,
            num_heads=num_heads,
            sigmas=sigmas,
            dropout=attention_dropout,
            window=window,
            window_length=window_length,
            out_projection=out_projection,
        )
        K = self.attention.num_branches
        self.dropout = Dropout(dropout)
        self.norm_weight = nn.Parameter(torch.ones(K, hidden_size))  # per-branch LayerNorm affine
        self.norm_bias = nn.Parameter(torch.zeros(K, hidden_size))
        self.clip_parts = {"norm_weight": K, "norm_bias": K}  # one LayerNorm per branch in the reference
        self.ffn: nn.Module | None = None
        if ffn_size:
            inner = ffn_inner(ffn_activation, dropout if ffn_dropout else 0.0)
            self.ffn = nn.Sequential(nn.Linear(hidden_size, ffn_size), inner, nn.Linear(ffn_size, hidden_size))
            self.ffn_norm = LayerNorm(hidden_size)

    @property
    def sigmas(self) -> tuple[float, ...]:
        return self.attention.sigmas

    def forward_packed(self, x: Tensor, packing: Packing) -> Tensor:
        """(N, D) packed tokens -> (N, D)."""
        branches = self.attention.forward_packed(x, packing)  # (K, N, D)
        K, D = branches.shape[0], branches.shape[-1]
        weights = (self.norm_weight / K).unbind(0)  # the mean over branches folded into the affine
        biases = (self.norm_bias / K).unbind(0)
        y: Tensor | None = None
        p = self.dropout.p
        dropped = self.training and p > 0
        if dropped or torch.is_grad_enabled():
            # residual (and dropout in the same pass)
            if dropped:
                h = residual_dropout_draw(x, branches, dropout_draw(branches.shape, p, branches.device, deferred=True), p)
            else:
                h = branches + x  # (K, N, D)
            for h_k, w_k, b_k in zip(h.unbind(0), weights, biases):  # unbind: a one-pass backward
                y_k = layer_norm(h_k, w_k, b_k)  # (N, D)
                y = y_k if y is None else y + y_k
        else:  # inference: one branch's (N, D) residual sum at a time, not the (K, N, D) one; summed in place
            for a_k, w_k, b_k in zip(branches.unbind(0), weights, biases):
                y_k = F.layer_norm(x + a_k, (D,), w_k, b_k)  # (N, D)
                y = y_k if y is None else y.add_(y_k)
        if self.ffn is not None:
            y = self.ffn_norm(y + self.dropout(relu_ffn(self.ffn, y)))  # (N, D)
        return y


class TransformerLayer(GMMBlock):
    """A post-norm transformer layer: one plain attention branch (sigma = inf).

    ``ffn_size``: the feed-forward width, None (the default): 4 * hidden_size;
    0 leaves only the attention sublayer (a BERT attention layer, as the
    reference query encoders).  ``ffn_activation`` / ``ffn_dropout`` /
    ``out_projection``: as :class:`GMMBlock` (GMMFormer v2 sets them to its
    reference's ReLU FFN with inner dropout and no output projection).
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int = 4,
        dropout: float = 0.1,
        attention_dropout: float = 0.0,
        ffn_size: int | None = None,
        ffn_activation: FfnActivation = "gelu",
        ffn_dropout: bool = False,
        out_projection: bool = True,
    ) -> None:
        super().__init__(
            hidden_size=hidden_size,
            num_heads=num_heads,
            sigmas=(math.inf,),
            dropout=dropout,
            attention_dropout=attention_dropout,
            ffn_size=ffn_size,
            ffn_activation=ffn_activation,
            ffn_dropout=ffn_dropout,
            out_projection=out_projection,
        )
