"""Generic building blocks shared by the backbones.

Sequences are either *padded* ``(B, L, D)`` with a ``(B, L)`` mask (True on
real tokens, real tokens first) or *packed* ``(N, D)``: only the N real
tokens, described by a :class:`Packing`.  Token-wise layers (projections,
feed-forward networks, normalisation) run on packed tokens so that no compute
is spent on padding; only attention needs the padded layout.

The backbone scaffolding at the end is what every backbone builds from:
:class:`BackboneSizes` (the shared constructor checks), the
:class:`SequenceEncoder` / :class:`QueryEncoder` of its query, clip and frame
streams, :class:`PooledFrameBackbone` (a max-over-clips branch beside a
pooled frame branch), :func:`resolve_ffn_size` (what ``ffn_size`` means) and
:func:`legacy_encoder_keys` (checkpoint keys of the layout before encoders).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import flop_registry, register_flop_formula

from prvrlab.checks import check_int, check_layer_count, check_positive_int, check_probability, is_number
from prvrlab.data.batch import host_lengths, host_to_device
from prvrlab.models.base import BranchScores, QueryEmbedding, RetrievalModel, VideoEmbedding
from prvrlab.models.column_sum import column_sum, relu_grad_column_sum
from prvrlab.models.component import FRAME_TOKENS
from prvrlab.models.layer_norm import LayerNorm, layer_norm
from prvrlab.models.layer_norm import branch_layer_norm as native_branch_layer_norm
from prvrlab.models.precision import weight_cast
from prvrlab.models import initialization, random_bits, row_chunks
from prvrlab.models.random_bits import DeferredDraw, apply_mask_, random_mask, random_words
from prvrlab.models.scoring import index_token_norms, indexed_norms, indexed_score_elements, max_scores, vector_scores


CUDA_NONZERO_STATIC = torch.torch_version.TorchVersion(torch.__version__) >= (2, 6)  # CUDA kernel since torch 2.6


def dropout_mask(x: Tensor, p: float) -> Tensor:
    """The inverted-dropout multiplier of ``x``: 0 with probability ``p``, else 1/(1-p) (x's shape and dtype).

    On CPU the mask is drawn from 16-bit random integers, four per 64-bit word
    of :func:`~prvrlab.models.random_bits.random_words` (seeded from the global
    torch RNG; drop probability rounded to 1/65536):
    ``torch.nn.functional.dropout`` draws one Bernoulli variate per element,
    which dominates the cost of dropout on CPU.
    """
    return mask_from_draw(dropout_draw(x.shape, p, x.device, x.dtype), p, x.dtype)


def dropout_draw(
    shape: Sequence[int], p: float, device: torch.device, dtype: torch.dtype | None = None, deferred: bool = False
) -> Tensor | DeferredDraw:
    """The random draw behind :func:`dropout_mask` of a tensor of ``shape``, taken now and turned into the
    mask later by :func:`mask_from_draw` (slices of it give the matching slices of the mask): int16 on
    CPU (2 bytes an element), the float32 mask elsewhere.  With ``dtype`` (a float type) on CPU, the mask
    itself in that dtype where the kernel can write it (:func:`~prvrlab.models.random_bits.random_mask`: one
    pass, the same values from the same draw); ``mask_from_draw`` returns it as it is.  ``deferred`` (CPU,
    with the kernel): a :class:`~prvrlab.models.random_bits.DeferredDraw`, nothing written, for
    :func:`apply_dropout_` (the same values again)."""
    if device.type != "cpu":
        return torch.empty(tuple(shape), device=device).bernoulli_(1.0 - p).div_(1.0 - p)
    shape = tuple(shape)
    threshold = draw_threshold(p)
    if threshold <= 32767 and (deferred or dtype is not None) and random_bits.load() is not None:
        if deferred:
            return DeferredDraw(shape)
        mask = random_mask(shape, threshold, _keep_scale(p, dtype))
        if mask is not None:
            return mask
    n = math.prod(shape)
    bits = random_words((n + 3) // 4)  # (n/4,) int64
    return bits.view(torch.int16)[:n].view(shape)  # uniform over [-32768, 32767]


def draw_threshold(p: float) -> int:
    """The least int16 draw an element survives dropout ``p`` with (above 32767 for p >= 1 - 2^-17: none)."""
    return -32768 + round(p * 65536)


def _keep_scale(p: float, dtype: torch.dtype) -> Tensor:
    """1/(1-p) rounded to ``dtype`` once (from the double): the value every kept element of a mask takes."""
    return torch.tensor(1.0 / (1.0 - p), dtype=dtype, device="cpu")


def mask_from_draw(draw: Tensor | DeferredDraw, p: float, dtype: torch.dtype) -> Tensor:
    """The dropout multiplier (``dtype``) of a :func:`dropout_draw` (or of a slice of one)."""
    threshold = draw_threshold(p)
    if threshold > 32767:  # no int16 draw survives (a comparison in int16 would wrap and keep all)
        return torch.zeros(draw.shape, dtype=dtype, device=getattr(draw, "device", None))
    if isinstance(draw, DeferredDraw):
        mask = random_mask(draw.shape, threshold, _keep_scale(p, dtype), draw)
        if mask is None:  # a dtype the kernel does not write (float64): float32's mask, rescaled below
            mask = random_mask(draw.shape, threshold, _keep_scale(p, torch.float32), draw)
        if mask is None:
            raise RuntimeError(f"a deferred dropout draw needs the random-bits kernel: {random_bits.unavailable_reason()}")
        draw = mask
    if draw.dtype == torch.int16:
        return torch.where(draw >= threshold, _keep_scale(p, dtype), torch.zeros((), dtype=dtype))
    if draw.dtype == dtype:
        return draw
    if draw.device.type == "cpu":  # a CPU mask of another dtype: its kept elements, at this dtype's scale
        return torch.where(draw != 0, _keep_scale(p, dtype), torch.zeros((), dtype=dtype))
    return draw.to(dtype)


def apply_dropout_(x: Tensor, draw: Tensor | DeferredDraw, p: float) -> Tensor:
    """``x.mul_(mask_from_draw(draw, p, x.dtype))``: in place, and without writing the mask for a deferred
    draw where the kernel takes ``x`` (:func:`~prvrlab.models.random_bits.apply_mask_`); the same values."""
    threshold = draw_threshold(p)
    if isinstance(draw, DeferredDraw) and threshold <= 32767 and apply_mask_(x, draw, threshold, float(_keep_scale(p, x.dtype))):
        return x
    return x.mul_(mask_from_draw(draw, p, x.dtype))


def fast_dropout(x: Tensor, p: float, training: bool) -> Tensor:
    """Inverted dropout with :func:`dropout_mask` on CPU, ``F.dropout`` elsewhere.  On CPU with the random-bits
    kernel, a bf16 / float32 ``x``: the mask is never written (:class:`_DeferredDropout`); the same values."""
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu":
        return F.dropout(x, p, training=True)
    if x.dtype in (torch.bfloat16, torch.float32) and draw_threshold(p) <= 32767 and random_bits.load() is not None:
        return _DeferredDropout.apply(x.contiguous(), DeferredDraw(tuple(x.shape)), p)
    return x * dropout_mask(x, p)


class _DeferredDropout(torch.autograd.Function):
    """``x * mask`` for the mask of a :class:`~prvrlab.models.random_bits.DeferredDraw` taken as
    :func:`dropout_mask` takes its draw (so the same mask): forward and backward each read their input once
    and write their output once, where the mask was written, read by the multiply and kept for the backward
    ((9786, 3072) bf16, the frames' input dropout: 60 MB written and read twice, held through the step).
    The backward is the same product with the same draw, so it is differentiable again."""

    @staticmethod
    def forward(ctx, x: Tensor, draw: DeferredDraw, p: float) -> Tensor:
        ctx.draw, ctx.p = draw, p
        return _apply_draw(x, draw, p)

    @staticmethod
    def backward(ctx, g: Tensor):
        return _DeferredDropout.apply(g.contiguous(), ctx.draw, ctx.p), None, None


def _apply_draw(x: Tensor, draw: DeferredDraw, p: float) -> Tensor:
    """``x`` times the mask of ``draw`` for dropout ``p`` at ``x``'s dtype, in one pass where the kernel takes it."""
    out = random_bits.masked(x, draw, draw_threshold(p), float(_keep_scale(p, x.dtype)))
    return x * mask_from_draw(draw, p, x.dtype) if out is None else out


def residual_dropout(x: Tensor, a: Tensor, mask: Tensor) -> Tensor:
    """``x + a * mask`` (``x`` broadcast to ``a``'s shape; ``mask`` a dropout multiplier without a gradient)
    in one pass, as ``torch.addcmul``, whose backward multiplies ``a``'s gradient by the mask and then again
    by its scalar value 1, one more pass over the largest tensors of a block ((8, 9786, 384) bf16: ~45 ms
    on a 2-core CPU).  Here the backward is ``g * mask`` and ``g`` summed to ``x``'s shape: the same values."""
    return _ResidualDropout.apply(x, a, mask)


class _ResidualDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, a: Tensor, mask: Tensor) -> Tensor:
        ctx.save_for_backward(mask)
        ctx.x_shape = x.shape
        return torch.addcmul(x, a, mask)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        (mask,) = ctx.saved_tensors
        gx = g.sum_to_size(ctx.x_shape) if ctx.needs_input_grad[0] else None
        ga = g * mask if ctx.needs_input_grad[1] else None
        return gx, ga, None


def residual_dropout_draw(x: Tensor, a: Tensor, draw: Tensor | DeferredDraw, p: float) -> Tensor:
    """:func:`residual_dropout` with the mask of a :func:`dropout_draw` for dropout ``p``: the same values.  For a
    :class:`~prvrlab.models.random_bits.DeferredDraw` and bf16 CPU tensors the mask is never written: the forward
    adds ``a`` times it to ``x`` and the backward multiplies ``a``'s gradient by it, each in one pass
    (:func:`~prvrlab.models.random_bits.residual_masked`), where the written mask cost a pass to write, one to
    read forward and one backward, and stayed in memory until then (v2's (8, 9,786, 384) bf16: 60 MB each)."""
    threshold = draw_threshold(p)
    if isinstance(draw, DeferredDraw) and threshold <= 32767 and random_bits.residual_takes(x, a, draw, threshold):
        return _DeferredResidualDropout.apply(x, a, draw, p)
    return residual_dropout(x, a, mask_from_draw(draw, p, a.dtype))


class _DeferredResidualDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, a: Tensor, draw: DeferredDraw, p: float) -> Tensor:
        ctx.draw, ctx.p, ctx.x_shape = draw, p, x.shape
        return random_bits.residual_masked(x, a, draw, draw_threshold(p), float(_keep_scale(p, a.dtype)))  # (k, N, D)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        gx = g.sum_to_size(ctx.x_shape) if ctx.needs_input_grad[0] else None
        ga = _apply_draw(g.contiguous(), ctx.draw, ctx.p) if ctx.needs_input_grad[1] else None
        return gx, ga, None, None


class Dropout(nn.Module):
    """Drop-in ``nn.Dropout`` using :func:`fast_dropout` (a cheaper mask on CPU)."""

    def __init__(self, p: float = 0.1, *, name: str = "dropout") -> None:
        super().__init__()
        self.p = check_probability(p, name)

    def forward(self, x: Tensor) -> Tensor:
        return fast_dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"


def autocast_input(x: Tensor) -> Tensor:
    """``x`` cast to the autocast dtype when autocast is on for its device (else unchanged)."""
    device = x.device.type
    if x.is_floating_point() and torch.is_autocast_enabled(device):
        return x.to(torch.get_autocast_dtype(device))
    return x


class BranchLinear(nn.Module):
    """K independent Linear(in_dim, out_dim) maps applied as one batched GEMM.

    ``weight`` (K, out_dim, in_dim), ``bias`` (K, out_dim); input (K, N, in_dim)
    -> output (K, N, out_dim), branch k using ``weight[k]``.
    """

    linear_like = True  # initialisation.init_normal_ draws it as an nn.Linear

    def __init__(self, *, num_branches: int, in_dim: int, out_dim: int) -> None:
        super().__init__()
        shape = (
            check_positive_int(num_branches, "num_branches"),
            check_positive_int(out_dim, "out_dim"),
            check_positive_int(in_dim, "in_dim"),
        )
        self.weight = nn.Parameter(torch.empty(shape))
        self.bias = nn.Parameter(torch.zeros(num_branches, out_dim))
        self.clip_parts = {"weight": num_branches, "bias": num_branches}  # one Linear per branch in the reference
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: Tensor, branches: slice = slice(None)) -> Tensor:
        """(k, N, in_dim) -> (k, N, out_dim): the ``branches`` (all by default; k of them).

        One GEMM per branch with its bias added inside the GEMM (:func:`branch_mlp`); with autograd
        off the CPU, one batched GEMM: the same values (tests/models/test_fast_paths.py)."""
        return branch_mlp(x, self, None, branches)


def branch_mlp(
    x: Tensor,
    first: BranchLinear,
    second: BranchLinear | None,
    branches: slice = slice(None),
    draw: Tensor | None = None,
    p: float = 0.0,
) -> Tensor:
    """``second(relu(first(x)))`` per branch, or ``first(x)`` without ``second``: (k, N, in) -> (k, N, out).

    ``draw`` (k, N, hidden), with ``second``: a :func:`dropout_draw` for dropout ``p`` on the ReLU's
    output, inside the MLP (GMMFormer v2's reference ``FeedForward``: Linear -> ReLU -> Dropout ->
    Linear); every path below applies it, turning one branch's slice of the draw into its mask at a
    time.

    The branches run one at a time, each bias added inside its GEMM and, on a
    CPU with oneDNN, the ReLU fused into the first GEMM.  At inference one
    branch's (N, hidden) activation is alive instead of all k: v2's branch FFN
    in bf16 on an AMX CPU, (8, 8000, 384) through 1,536 hidden units, 0.09 s
    instead of 0.20 s for batched GEMMs (v2's video encoding of 2,500 x 500 in
    benchmarks/bench_eval.py: 4.1 -> 3.6 s).  With autograd on a CPU the same
    per-branch GEMMs run forward and backward in :class:`_BranchGemms`; on other
    devices (not measured there) batched GEMMs.  Under autocast the GEMMs take
    its dtype.
    """
    layers = (first,) if second is None else (first, second)
    return _mlp(x, [(layer.weight, layer.bias) for layer in layers], branches, draw, p)


def _mlp(x: Tensor, layers: list[tuple[Tensor, Tensor]], branches: slice, draw, p: float) -> Tensor:
    """:func:`branch_mlp` from its layers' (k, out, in) weights and (k, out) biases (rows ``branches`` of them)."""
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    if draw is not None and (len(layers) == 1 or p <= 0):
        draw = None
    with torch.autocast(device, enabled=False):
        params = [weight_cast(t, dtype, branches) for layer in layers for t in layer]
        x = x.to(dtype)  # (k, N, in)
        if not torch.is_grad_enabled():
            return _branch_forward(x, *params, draw=draw, p=p)[0]
        if device == "cpu":
            return _BranchGemms.apply(x, *params, draw, p)
        return _batched_mlp(x, *params, draw=draw, p=p)


def relu_ffn(ffn: nn.Sequential, x: Tensor) -> Tensor:
    """``ffn(x)`` for (N, in) ``x`` and a ``Linear -> ReLU [-> Dropout] -> Linear`` FFN (:func:`~prvrlab.models.gmm.ffn_inner`'s
    layout; others run as they are): on a CPU with autograd, through :class:`_BranchGemms` as one branch (the
    ReLU fused into the first GEMM, the dropout applied in place from a deferred draw that takes the
    generator draw the ``Dropout`` module would, its backward folded into the second GEMM's and the ReLU's,
    and the first bias's gradient summed in the ReLU's backward pass): the same forward values.  (v2's query
    FFN, (12,116, 384) through 1,536 in bf16.)"""
    if not (isinstance(ffn, nn.Sequential) and len(ffn) == 3):
        return ffn(x)
    first, inner, second = ffn[0], ffn[1], ffn[2]
    parts = list(inner) if isinstance(inner, nn.Sequential) else [inner]
    drop = parts[1] if len(parts) == 2 else None
    takes = (
        x.device.type == "cpu" and x.dim() == 2 and torch.is_grad_enabled()
        and isinstance(parts[0], nn.ReLU) and len(parts) <= 2 and (drop is None or isinstance(drop, Dropout))
        and all(isinstance(m, nn.Linear) and m.bias is not None for m in (first, second))
    )
    if not takes:
        return ffn(x)
    p = drop.p if drop is not None and drop.training else 0.0
    draw = dropout_draw((1, x.shape[0], first.out_features), p, x.device, deferred=True) if p > 0 else None
    layers = [(m.weight[None], m.bias[None]) for m in (first, second)]  # (1, out, in), (1, out): one branch
    return _mlp(x[None], layers, slice(None), draw, p)[0]  # (N, out)


def _branch_forward(
    x: Tensor,
    w1: Tensor,
    b1: Tensor,
    w2: Tensor | None = None,
    b2: Tensor | None = None,
    keep: bool = False,
    draw: Tensor | None = None,
    p: float = 0.0,
):
    """(k, N, out) output of :func:`branch_mlp` by per-branch GEMMs, and the (N, hidden) second-GEMM inputs
    (the ReLU outputs, dropped where ``draw`` is given) if ``keep``.

    x (k, N, in), w1 (k, hidden, in), b1 (k, hidden), w2 (k, out, hidden), b2 (k, out): one dtype."""
    last_w, last_b = (w1, b1) if w2 is None else (w2, b2)
    y = x.new_empty((x.shape[0], x.shape[1], last_w.shape[1]))  # (k, N, out)
    hidden = []
    for k in range(x.shape[0]):
        h = x[k]  # (N, in)
        if w2 is not None:
            h = _linear_relu(h, w1[k], b1[k])  # (N, hidden)
            if draw is not None:
                h = apply_dropout_(h, draw[k], p)  # in place: the ReLU's output is not kept
            if keep:
                hidden.append(h)
        torch.addmm(last_b[k], h, last_w[k].t(), out=y[k])
    return y, hidden


def _batched_mlp(
    x: Tensor,
    w1: Tensor,
    b1: Tensor,
    w2: Tensor | None = None,
    b2: Tensor | None = None,
    draw: Tensor | None = None,
    p: float = 0.0,
) -> Tensor:
    """:func:`branch_mlp` as batched GEMMs with autograd (arguments as :func:`_branch_forward`)."""
    h = torch.baddbmm(b1[:, None, :], x, w1.transpose(1, 2))  # (k, N, hidden)
    if w2 is None:
        return h
    # ReLU in place: the GEMM's output is not needed by its backward
    h = F.relu(h, inplace=True)
    if draw is not None:
        h = h * mask_from_draw(draw, p, h.dtype)
    return torch.baddbmm(b2[:, None, :], h, w2.transpose(1, 2))  # (k, N, out)


def weight_grad(g: Tensor, x: Tensor, out: Tensor | None = None) -> Tensor:
    """``gᵀ x``, a linear layer's (out, in) weight gradient from its output gradient ``g`` (M, out) and input ``x``
    (M, in), contiguous (into ``out`` if given).  In bf16 on a CPU, where ``out < in`` the transposed product
    ``(xᵀ g)ᵀ`` is computed and copied: oneDNN runs the long reduction faster with the wide side as rows
    ((9786, 384) x (9786, 1536) on AMX: 7.1 against 9.3 ms; the copy is one (out, in) pass).  The same
    products and float32 sums (only their order may differ), one rounding."""
    if g.device.type == "cpu" and g.dtype == torch.bfloat16 and g.shape[1] < x.shape[1]:
        product = torch.mm(x.t(), g).t()  # (out, in), a transposed view
        return product.contiguous() if out is None else out.copy_(product)
    return torch.mm(g.t(), x) if out is None else torch.mm(g.t(), x, out=out)


class _BranchGemms(torch.autograd.Function):
    """``relu(x_k W1_kᵀ + b1_k) W2_kᵀ + b2_k`` (or ``x_k W1_kᵀ + b1_k``) for each branch k, forward and backward.

    Every tensor in one dtype.  One 2-D GEMM per branch and per product, biases inside the forward
    GEMMs, the ReLU fused into the first and its backward applied to one branch's (N, hidden)
    gradient at a time (the batched form holds all k).  The ReLU's output is saved once, as the
    second GEMM's input.  With a dropout ``draw`` (dropout ``p`` after the ReLU) the saved input is
    the dropped ReLU output ``d``: ``d > 0`` exactly where the ReLU and the mask both pass, so the ReLU's
    and the dropout's backward are one ``threshold_backward`` on ``d`` times 1/(1-p); nothing more is
    saved; the scale is applied inside the backward's GEMM (its alpha: one rounding, and no extra pass
    over the (N, hidden) gradient: 12.5 -> 6.6 ms a branch in bf16).  v2's branch FFN, (8, 9786, 384)
    through 1,536 hidden units in bf16 on a noisy AMX CPU, forward + backward, 20 alternating pairs:
    1.04x the batched GEMMs' speed (median of the pairs' ratios; best 0.94 vs 1.01 s), with one branch's
    (N, hidden) gradient alive instead of k.
    """

    @staticmethod
    def forward(
        ctx,
        x: Tensor,
        w1: Tensor,
        b1: Tensor,
        w2: Tensor | None = None,
        b2: Tensor | None = None,
        draw: Tensor | None = None,
        p: float = 0.0,
    ) -> Tensor:
        y, hidden = _branch_forward(x, w1, b1, w2, b2, keep=True, draw=draw, p=p)  # (k, N, out), k x (N, hidden)
        ctx.save_for_backward(x, w1, w2, *hidden)
        # the multiplier as mask_from_draw rounds it to the dtype (bf16: 1/(1-p) is rarely exact)
        ctx.scale = None if draw is None else float(_keep_scale(p, x.dtype))
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        # g (k, N, out)
        x, w1, w2, *hidden = ctx.saved_tensors
        need_x = ctx.needs_input_grad[0]
        gx = torch.empty_like(x) if need_x else None  # (k, N, in)
        gw1, gb1 = torch.empty_like(w1), x.new_empty(w1.shape[:2])  # (k, hidden, in), (k, hidden)
        gw2 = None if w2 is None else torch.empty_like(w2)  # (k, out, hidden)
        for k in range(x.shape[0]):
            gh = g[k]  # (N, out); below, with a second layer, (N, hidden): the gradient at the first GEMM's output
            if w2 is not None:
                h = hidden[k]  # (N, hidden)
                weight_grad(gh, h, out=gw2[k])
                if ctx.scale is None:
                    gh = torch.mm(gh, w2[k])  # (N, hidden)
                else:  # the kept elements' dropout scale (dropped ones: h = 0, cut below), inside the GEMM
                    gh = torch.addmm(gh.new_empty(()), gh, w2[k], beta=0, alpha=ctx.scale)  # (N, hidden)
                gh = relu_grad_column_sum(gh, h, gb1[k])  # the ReLU's backward and the first bias's gradient
            else:
                column_sum(gh, out=gb1[k])
            weight_grad(gh, x[k], out=gw1[k])
            if need_x:
                torch.mm(gh, w1[k], out=gx[k])
        if w2 is None:
            return gx, gw1, gb1, None, None, None, None
        return gx, gw1, gb1, gw2, g.sum(1), None, None


def _linear_relu(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """``relu(x @ weight.T + bias)`` for 2-D ``x``, in one oneDNN call on CPU where it is built in."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and _fused_linear(x.dtype):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "relu", [], "")
    return F.relu(F.linear(x, weight, bias), inplace=True)


def project(layer: nn.Linear, x: Tensor, parts: int = 1) -> Tensor | tuple[Tensor, ...]:
    """``layer(x)``, or with ``parts`` > 1 its ``parts`` equal column blocks (``layer(x).chunk(parts, -1)``,
    e.g. Q, K and V).  At inference in bf16 on a CPU (bf16 autocast or a bf16 ``x``), with a bias and a
    contiguous ``x``: one oneDNN call per block that adds the bias inside the GEMM.  ``F.linear`` there first copies
    the bias into every row of the output and then accumulates the product onto it, one more pass over
    the (N, out) output (GaussianAttention's Q/K/V, (6,052, 384) -> 4,608 in bf16: 32 -> 22 ms).  The same
    values: bf16 operands, float32 accumulation plus the bias, one rounding.  Blocks come out contiguous,
    and narrower products run faster here: GMMFormer's Q/K/V ((8,704, 384) -> 4,608, AVX512-BF16 CPU)
    at 410 GFLOP/s as three 1,536-wide products against 293 as one, bit for bit the same values.  With
    autograd (same conditions) one such call for the whole output and ``addmm``'s backward
    (:class:`_BiasLinear`), split into views as ``F.linear``'s output would be."""
    if x.device.type != "cpu" or layer.bias is None or not x.is_contiguous():
        return _split(layer(x), parts)
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else x.dtype
    if dtype != torch.bfloat16 or not _fused_linear(dtype) or layer.out_features % parts:
        return _split(layer(x), parts)
    x = x.to(dtype)
    if torch.is_grad_enabled():
        flat = x.reshape(-1, x.shape[-1])  # (M, in)
        y = _BiasLinear.apply(flat, weight_cast(layer.weight, dtype), weight_cast(layer.bias, dtype))  # (M, out)
        return _split(y.view(*x.shape[:-1], layer.out_features), parts)
    blocks = zip(weight_cast(layer.weight, dtype).chunk(parts), weight_cast(layer.bias, dtype).chunk(parts))
    out = tuple(torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "") for w, b in blocks)
    return out[0] if parts == 1 else out  # (N, out / parts) each; the weights cast as autocast casts them


class _BiasLinear(torch.autograd.Function):
    """``x @ weightᵀ + bias`` for 2-D ``x`` in one oneDNN call with the bias inside the GEMM, and the
    backward ``addmm`` has (the same products, so the same gradients): ``F.linear`` on a CPU copies the
    bias into every row of the output before the GEMM, one more pass over it (v2's Q/K/V for 9,786
    frames, (9786, 9216) bf16: 35 ms of copying a step)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
        # x (M, in), weight (out, in), bias (out,)
        ctx.save_for_backward(x, weight)
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")  # (M, out)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        # g (M, out)
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        gx = torch.mm(g, weight) if need_x else None  # (M, in)
        gw = weight_grad(g, x) if need_w else None  # (out, in), contiguous: addmm's product for F.linear's weight
        gb = column_sum(g) if need_b else None  # (out,)
        return gx, gw, gb


def _split(y: Tensor, parts: int) -> Tensor | tuple[Tensor, ...]:
    return y if parts == 1 else y.chunk(parts, dim=-1)


def _fused_linear_flops(x_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of ``mkldnn._linear_pointwise`` for ``FlopCounterMode`` (it has none of its own, so the products
    :func:`project` and :func:`_linear_relu` run through it went uncounted): 2 x rows x in x out.  The weight
    (out, in) is the second argument, or the third in the ``binary`` overload ``(x, other, weight, bias, attr)``,
    told apart by where its first string (``attr``) stands."""
    weight = args[0] if isinstance(args[2], str) else args[1]
    return 2 * math.prod(x_shape[:-1]) * x_shape[-1] * weight[0]


if hasattr(torch.ops.mkldnn, "_linear_pointwise") and torch.ops.mkldnn._linear_pointwise not in flop_registry:
    register_flop_formula(torch.ops.mkldnn._linear_pointwise)(_fused_linear_flops)


@functools.lru_cache(maxsize=None)
def _fused_linear(dtype: torch.dtype) -> bool:
    """Whether this torch has oneDNN's fused linear + pointwise op (a private op: checked, not assumed) and,
    for bf16, this CPU runs oneDNN's bf16 products: an AVX2-only CPU refuses to create the primitive
    ("could not create a primitive descriptor"), where ``F.linear`` falls back to ATen's own bf16 GEMM."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    if dtype == torch.bfloat16:
        probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
        return bool(probe is not None and probe())
    return True


def branch_layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-5) -> Tensor:
    """LayerNorm over the last dim of (K, N, D) with a per-branch affine ``weight``/``bias`` (K, D).

    One native LayerNorm per branch (:func:`~prvrlab.models.layer_norm.layer_norm`: the fused bf16
    backward), its affine inside the kernel (and its weight and bias gradients inside the kernel's
    backward): (8, 9786, 384) in bf16, forward + backward, 0.14 s against 0.22 s
    for one affine-free LayerNorm followed by a broadcast multiply-add, which also rounded to bf16
    twice.  (Writing each branch into a slice of one output with ATen's ``out=`` kernels was tried: those
    kernels compute and then copy, and in a v2 training step, whose gradients arrive strided, the
    backward's copies cost more than the stacks they replace.)  With autograd on bf16 CPU tensors, all
    branches in one kernel call instead (:func:`~prvrlab.models.layer_norm.branch_layer_norm`: no stacks)."""
    fused = native_branch_layer_norm(x, weight, bias, eps)  # (K, N, D) or None
    if fused is not None:
        return fused
    return torch.stack([layer_norm(x_k, w_k, b_k, eps) for x_k, w_k, b_k in zip(x, weight, bias)])  # (K, N, D)


init_normal_ = initialization.init_normal_  # importable from here too (plug-ins written against earlier releases)


def decay_norm_gains(module: nn.Module, decayed: bool = True) -> None:
    """Mark the LayerNorm gains under ``module`` weight-decayed (``decayed_parameters``, read by the
    trainer's grouping), or, with ``decayed=False``, drop such marks: the ``weight`` of every LayerNorm
    module and the gains among a module's ``norm_parameters`` (plain (K, D) affines; names not ending in
    ``bias``).  Biases stay exempt.  For references whose name-based grouping (``no_decay`` =
    ``LayerNorm.weight``, ...) misses LayerNorms named otherwise (``norm1``, ``layer_norm``)."""
    for m in module.modules():
        if isinstance(m, nn.LayerNorm):
            gains: tuple[str, ...] = ("weight",) if m.weight is not None else ()
        else:
            gains = tuple(n for n in getattr(m, "norm_parameters", ()) if not n.endswith("bias"))
        if gains and decayed:
            m.decayed_parameters = gains
        elif "decayed_parameters" in m.__dict__:
            del m.decayed_parameters


PADDED_FIRST_MAX = 0.25  # share of padded slots up to which inference maps tokens before packing (Packing.padded_first)


@dataclass(frozen=True)
class Packing:
    """Where the real tokens of a padded ``(B, L)`` batch are.

    ``lengths`` (B,) real tokens per row; ``positions`` (N,) position of each
    real token in its row; ``index`` (N,) flat index ``b * L + t`` of each real
    token, or None when nothing is padded (packing is then a free reshape).
    ``keys`` (B, L) bool, only in a :meth:`grid`: every slot is a token, but
    attention looks at these only.  ``window_span``: the length a ``padded``
    Gaussian window spans where it is not ``length`` (a length bucket of a
    batch padded to that length, :func:`~prvrlab.models.gmm.length_buckets`).
    """

    batch: int
    length: int
    lengths: Tensor
    positions: Tensor
    index: Tensor | None
    mask: Tensor
    keys: Tensor | None = None
    window_span: int | None = None

    @staticmethod
    def grid(mask: Tensor) -> "Packing":
        """Every slot of a padded ``(B, L)`` batch a token, attention restricted to the real ones of
        ``mask``: the layout of a reference encoder that runs over the padding and keeps its outputs there
        (each computed from the row's real tokens)."""
        batch, length = mask.shape
        full = Packing.full(batch, length, mask.device)
        keys = mask.to(torch.bool)
        return Packing(batch, length, full.lengths, full.positions, None, full.mask, keys)

    @property
    def key_mask(self) -> Tensor | None:
        """(B, L) bool: the tokens attention may look at; None: all of them."""
        if self.keys is not None:
            return self.keys
        return None if self.is_full else self.mask

    @staticmethod
    def full(batch: int, length: int, device: torch.device | str) -> "Packing":
        """The packing of a batch without padding."""
        lengths = torch.full((batch,), length, dtype=torch.long, device=device)
        positions = torch.arange(length, device=device).repeat(batch)  # (B*L,)
        mask = torch.ones(batch, length, dtype=torch.bool, device=device)
        return Packing(batch, length, lengths, positions, None, mask)

    @staticmethod
    def from_mask(mask: Tensor | None, batch: int, length: int, device: torch.device | str) -> "Packing":
        """The packing of a ``(B, L)`` prefix mask (None: no padding)."""
        if mask is None:
            return Packing.full(batch, length, device)
        if mask.shape != (batch, length):
            raise ValueError(f"mask has shape {tuple(mask.shape)}, expected {(batch, length)}")
        host = host_lengths(mask)
        mask = mask.to(device=device, dtype=torch.bool)
        if host is not None:  # the host built this mask from these lengths: nothing to read back
            return Packing.from_lengths(host, length, device, mask=mask)
        lengths = mask.sum(dim=1)  # (B,)
        is_prefix, real = _read_layout(mask, lengths)
        if not is_prefix:
            raise ValueError("masks must put real tokens first (True...True False...False per row)")
        if real == batch * length:
            return Packing.full(batch, length, device)
        flat = mask.reshape(-1)  # (B*L,)
        if flat.device.type == "cpu" or (flat.device.type == "cuda" and CUDA_NONZERO_STATIC):  # size known: no second read
            index = flat.nonzero_static(size=real).squeeze(1)  # (N,)
        else:
            index = flat.nonzero().squeeze(1)  # (N,)
        return Packing(batch, length, lengths, index % length, index, mask)

    @staticmethod
    def from_lengths(
        lengths: np.ndarray, length: int, device: torch.device | str, *, mask: Tensor | None = None
    ) -> "Packing":
        """The packing of rows with ``lengths`` (B,) real tokens first out of ``length``, laid out on the
        host and copied to ``device`` without waiting; ``mask``: that (B, L) prefix mask on ``device``
        where the caller has it (else it is copied too)."""
        lengths = np.asarray(lengths, dtype=np.int64)  # (B,)
        batch = len(lengths)
        if lengths.ndim != 1 or (batch and (int(lengths.min()) < 0 or int(lengths.max()) > length)):
            raise ValueError(f"lengths must be (B,) values in [0, {length}], got {lengths!r}")
        if int(lengths.sum()) == batch * length:
            return Packing.full(batch, length, device)
        real = np.arange(length)[None, :] < lengths[:, None]  # (B, L)
        index = host_to_device(np.flatnonzero(real), device)  # (N,)
        if mask is None:
            mask = host_to_device(real, device)
        return Packing(batch, length, host_to_device(lengths, device), index % length, index, mask)

    @property
    def is_full(self) -> bool:
        return self.index is None

    def padded_first(self) -> bool:
        """Whether a token-wise map (an input projection, GMMFormer's Q/K/V) should run on the padded
        layout and pack or keep its output, instead of running on the packed tokens: at inference (no
        autograd; the callers also require eval mode, so no dropout draw changes shape), with padding but
        at most :data:`PADDED_FIRST_MAX` of the slots padded (evaluation's by-length batches).  Packing the narrower output, or not unpacking a wider one, then costs less
        than the padding's rows (GMMFormer video encoding in bf16 on an AMX CPU: 11% faster from the
        Q/K/V alone, identical outputs); in training, with more padding, it did not pay (session 27)."""
        if self.index is None or torch.is_grad_enabled():
            return False
        return self.index.shape[0] >= (1.0 - PADDED_FIRST_MAX) * self.batch * self.length

    @property
    def num_tokens(self) -> int:
        return self.batch * self.length if self.index is None else int(self.index.shape[0])

    def rows(self) -> Tensor:
        """(N,) long: the batch row of every packed token."""
        device = self.positions.device
        if self.index is None:
            return torch.arange(self.batch, device=device).repeat_interleave(self.length)  # (B*L,)
        return torch.div(self.index, self.length, rounding_mode="floor")  # (N,)

    def pack(self, x: Tensor) -> Tensor:
        """(B, L, *F) -> (N, *F), keeping only real tokens."""
        flat = x.reshape(self.batch * self.length, *x.shape[2:])  # (B*L, *F)
        return flat if self.index is None else flat.index_select(0, self.index)

    def pack_input(self, x: Tensor) -> Tensor:
        """:meth:`pack` of an encoder's input, cast as :func:`autocast_input` casts it: float32 features under
        bf16 autocast on a CPU gathered and rounded in one pass (:func:`~prvrlab.models.row_chunks.gather_rows_bf16`:
        v2's frames, (9,786 of 16,384, 3,072): 19-29 -> 11-17 ms), the same values as packing and then casting."""
        if self.index is not None and x.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
            if torch.get_autocast_dtype("cpu") == torch.bfloat16 and x.dtype == torch.float32:
                flat = x.reshape(self.batch * self.length, *x.shape[2:])  # (B*L, *F)
                packed = row_chunks.gather_rows_bf16(flat, self.index)  # (N, *F) bf16, or None
                if packed is not None:
                    return packed
        return self.pack(x)

    def unpack(self, x: Tensor, dim: int = 0) -> Tensor:
        """(*P, N, *F) with the tokens at ``dim`` -> (*P, B, L, *F), zeros on padding."""
        lead, rest = x.shape[:dim], x.shape[dim + 1 :]
        if self.index is None:
            return x.reshape(*lead, self.batch, self.length, *rest)
        out = x.new_zeros(*lead, self.batch * self.length, *rest)  # (*P, B*L, *F)
        return out.index_copy_(dim, self.index, x).view(*lead, self.batch, self.length, *rest)  # in place: one pass


def _read_layout(mask: Tensor, lengths: Tensor) -> tuple[bool, int]:
    """Whether the (B, L) ``mask`` puts real tokens first, and how many it has: one read from its device
    (a wait on a GPU; masks marked with their host lengths skip it)."""
    steps = torch.arange(mask.shape[1], device=mask.device)
    prefix = (mask == (steps[None, :] < lengths[:, None])).all()
    is_prefix, real = torch.stack([prefix.long(), lengths.sum()]).tolist()
    return bool(is_prefix), int(real)


class PackedLayer(nn.Module):
    """A layer computed on packed real tokens (:meth:`forward_packed`); :meth:`forward` takes the padded layout."""

    def forward_packed(self, x: Tensor, packing: Packing) -> Tensor:
        """(N, D_in) packed tokens -> (N, D)."""
        raise NotImplementedError

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """(B, L, D_in) with (B, L) mask -> (B, L, D), zeros on padding."""
        packing = Packing.from_mask(mask, x.shape[0], x.shape[1], x.device)
        return packing.unpack(self.forward_packed(packing.pack(x), packing))


class InputProjection(nn.Module):
    """LayerNorm -> Dropout -> Linear -> ReLU, applied token-wise on (..., in_dim).

    ``checkpoint_activations`` (``train.checkpoint_activations``): keep only the input for the backward
    and recompute the rest there (the RNG state is restored, so the dropout mask is the same): the wide
    (..., in_dim) normalised, mask and dropped copies are not held through the step.
    """

    checkpoint_activations: bool = False

    def __init__(self, *, in_dim: int, out_dim: int, dropout: float = 0.1) -> None:
        super().__init__()
        check_positive_int(in_dim, "in_dim")
        check_positive_int(out_dim, "out_dim")
        self.norm = LayerNorm(in_dim)
        self.dropout = Dropout(dropout)
        self.linear = nn.Linear(in_dim, out_dim)

    def forward(self, x: Tensor) -> Tensor:
        """(..., in_dim) -> (..., out_dim); under autocast the wide input is cast first."""
        if self.checkpoint_activations and torch.is_grad_enabled():
            return checkpoint(self._project, x, use_reentrant=False)
        return self._project(x)

    def _project(self, x: Tensor) -> Tensor:
        # through project(): in bf16 on a CPU the bias inside the GEMM and, with autograd, weight_grad's
        # orientation of the (out_dim, in_dim) weight gradient (the wide side as rows) instead of ATen's
        # (out_dim, N)ᵀ product (v2's frames, (9,786, 3,072) -> 384, forward + backward: 108 -> 101 ms)
        out = project(self.linear, self.dropout(self.norm(autocast_input(x))))  # (..., out_dim)
        return F.relu(out, inplace=not torch.is_grad_enabled())  # in place at inference: half the passes


class PositionalEmbedding(nn.Module):
    """Learned positional embedding added to the tokens, then LayerNorm and Dropout."""

    def __init__(self, *, max_len: int, hidden_size: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.max_len = check_positive_int(max_len, "max_len")
        self.embedding = nn.Embedding(max_len, check_positive_int(hidden_size, "hidden_size"))
        self.norm = LayerNorm(hidden_size)
        self.dropout = Dropout(dropout)

    def _check(self, length: int) -> None:
        if length > self.max_len:
            raise ValueError(f"sequence length {length} exceeds the positional embedding's max_len={self.max_len}")

    def forward(self, x: Tensor) -> Tensor:
        """(B, L, D) -> (B, L, D)."""
        self._check(x.shape[1])
        pos = self.embedding.weight[: x.shape[1]]  # (L, D)
        return self.dropout(self.norm(x + pos))

    def forward_packed(self, x: Tensor, packing: Packing) -> Tensor:
        """(N, D) packed tokens -> (N, D)."""
        self._check(packing.length)
        if packing.is_full:  # broadcast add: a cheap backward (sum over the batch)
            pos = self.embedding.weight[: packing.length]  # (L, D)
            x = (x.view(packing.batch, packing.length, -1) + pos).view(packing.num_tokens, -1)
        else:
            x = x + self.embedding(packing.positions)  # (N, D)
        return self.dropout(self.norm(x))


class AttentionPooling(nn.Module):
    """Pool a sequence to one vector: Linear(d, 1) scores, masked softmax, weighted sum.

    The score layer has no bias (a softmax ignores it).  A row without any
    real token pools to the zero vector.
    """

    def __init__(self, *, hidden_size: int) -> None:
        super().__init__()
        self.score = nn.Linear(check_positive_int(hidden_size, "hidden_size"), 1, bias=False)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """(B, L, D) with (B, L) mask -> (B, D)."""
        logits = self.score(x).squeeze(-1).float()  # (B, L)
        return self._pool(x, logits, mask)

    def forward_packed(self, x: Tensor, packing: Packing) -> Tensor:
        """(N, D) packed tokens -> (B, D)."""
        logits = packing.unpack(self.score(x).squeeze(-1).float())  # (B, L)
        padded = packing.unpack(x)  # (B, L, D)
        return self._pool(padded, logits, None if packing.is_full else packing.mask)

    @staticmethod
    def _pool(x: Tensor, logits: Tensor, mask: Tensor | None) -> Tensor:
        if mask is not None:
            logits = logits.masked_fill(~mask, torch.finfo(logits.dtype).min)
        weights = torch.softmax(logits, dim=-1)  # (B, L)
        if mask is not None:
            weights = weights * mask  # fully padded rows pool to zero
        return torch.einsum("bl,bld->bd", weights.to(x.dtype), x)  # (B, D)


class AdditiveAttentionPooling(AttentionPooling):
    """Additive (Bahdanau) attention pooling: scores ``v^T tanh(W x + b)``, masked softmax, weighted sum.

    ``attention_size`` is the width of ``W`` (default: ``hidden_size``).  The
    same masking rules as :class:`AttentionPooling` (a row without real
    tokens pools to zero).
    """

    def __init__(self, *, hidden_size: int, attention_size: int | None = None) -> None:
        super().__init__(hidden_size=hidden_size)
        width = hidden_size if attention_size is None else check_positive_int(attention_size, "attention_size")
        self.project = nn.Linear(hidden_size, width)
        self.score = nn.Linear(width, 1, bias=False)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """(B, L, D) with (B, L) mask -> (B, D)."""
        logits = self.score(torch.tanh(self.project(x))).squeeze(-1).float()  # (B, L)
        return self._pool(x, logits, mask)

    def forward_packed(self, x: Tensor, packing: Packing) -> Tensor:
        """(N, D) packed tokens -> (B, D)."""
        logits = packing.unpack(self.score(torch.tanh(self.project(x))).squeeze(-1).float())  # (B, L)
        return self._pool(packing.unpack(x), logits, None if packing.is_full else packing.mask)


# ---------------------------------------------------------------- backbone scaffolding


def check_score_weights(weights: dict[str, float]) -> dict[str, float]:
    """Branch weights (finite, >= 0, not all zero) as floats; a ValueError names the bad one."""
    for name, value in weights.items():
        if not is_number(value) or value < 0:
            raise ValueError(f"{name}_weight must be a finite number >= 0, got {value!r}")
    if all(value == 0 for value in weights.values()):
        raise ValueError(f"score weights {weights!r} are all zero; at least one branch must count")
    return {name: float(value) for name, value in weights.items()}


def resolve_ffn_size(ffn_size: int | None, hidden_size: int) -> int:
    """What ``ffn_size`` means in every layer and backbone: the width of the feed-forward sublayer
    after an attention sublayer; 0: no feed-forward sublayer; None: ``4 * hidden_size``."""
    if ffn_size is None:
        return 4 * hidden_size
    return check_int(ffn_size, "ffn_size", minimum=0)


class SequenceEncoder(PackedLayer):
    """InputProjection -> PositionalEmbedding -> ``num_layers`` layers on the packed real tokens,
    plus an optional pooling head: the query, clip/moment and frame encoders of the backbones.

    ``layer()`` builds one layer and ``pool()`` the head, both modules with
    ``forward_packed(x, packing)`` on (N, D) packed tokens.  Submodules are
    built in the order ``proj``, ``pos``, ``layers`` (a ModuleList), ``pool``
    (None without a head), so a seeded construction always draws the same
    initial weights.
    """

    def __init__(
        self,
        *,
        in_dim: int,
        hidden_size: int,
        max_len: int,
        dropout: float,
        layer: Callable[[], nn.Module],
        num_layers: int = 1,
        pool: Callable[[], nn.Module] | None = None,
    ) -> None:
        super().__init__()
        check_layer_count(num_layers, "num_layers")
        self.proj = InputProjection(in_dim=in_dim, out_dim=hidden_size, dropout=dropout)
        self.pos = PositionalEmbedding(max_len=max_len, hidden_size=hidden_size, dropout=dropout)
        self.layers = nn.ModuleList(layer() for _ in range(num_layers))
        self.pool = None if pool is None else pool()

    def encode(self, x: Tensor, mask: Tensor | None = None) -> tuple[Tensor, Packing]:
        """(B, L, in_dim) features with a (B, L) mask (None: no padding) -> (N, D) encodings of the
        real tokens, and their packing."""
        packing = Packing.from_mask(mask, x.shape[0], x.shape[1], x.device)
        if not self.training and packing.padded_first():  # project the (B, L, in_dim) input, pack the (N, D) output
            return self.encode_projected(packing.pack(self.proj(x)), packing), packing
        return self.forward_packed(packing.pack_input(x), packing), packing

    def encode_padded(self, x: Tensor, mask: Tensor) -> Tensor:
        """(B, L, in_dim) features with a (B, L) mask -> (B, L, D) encodings at every slot, the padded ones
        too, each from the row's real tokens (:meth:`Packing.grid`): what a reference encoder run over the
        padding outputs there.  The real slots equal :meth:`encode`'s, up to rounding."""
        packing = Packing.grid(mask)
        t = self.forward_packed(x.reshape(packing.num_tokens, -1), packing)  # (B*L, D)
        return t.view(packing.batch, packing.length, -1)  # (B, L, D)

    def forward_packed(self, x: Tensor, packing: Packing) -> Tensor:
        """(N, in_dim) packed features -> (N, D)."""
        return self.encode_projected(self.proj(x), packing)

    def encode_projected(self, t: Tensor, packing: Packing) -> Tensor:
        """(N, D) projected tokens -> (N, D): positions and layers."""
        t = self.pos.forward_packed(t, packing)  # (N, D)
        for layer in self.layers:
            t = layer.forward_packed(t, packing)  # (N, D)
        return t

    def pooled(self, t: Tensor, packing: Packing) -> Tensor:
        """(N, D) encodings -> the head's (B, ...) output."""
        if self.pool is None:
            raise ValueError("this SequenceEncoder has no pooling head")
        return self.pool.forward_packed(t, packing)


class QueryEncoder(SequenceEncoder):
    """A :class:`SequenceEncoder` whose head turns queries into one vector per retrieval branch."""

    def embed(
        self, queries: Tensor, query_mask: Tensor, *, branches: Sequence[str], keep_tokens: bool = True
    ) -> QueryEmbedding:
        """(Nq, Lq, Dq) tokens with (Nq, Lq) mask -> branch vectors and, with ``keep_tokens``, the
        (Nq, Lq, D) word tokens (a backbone passes whether the ``word_tokens`` capability is requested
        now: an evaluation of GMMFormer at TVR's test size kept 0.3 GB of them for nothing).

        A head output (Nq, D) is one vector shared by every branch; (Nq, K, D)
        gives the K ``branches`` one vector each, in order.
        """
        t, packing = self.encode(queries, query_mask)  # (Nt, D)
        pooled = self.pooled(t, packing)  # (Nq, D) or (Nq, K, D)
        if pooled.dim() == 2:
            vectors = {branch: pooled for branch in branches}
        else:
            if pooled.shape[1] != len(branches):
                raise ValueError(f"the query head gives {pooled.shape[1]} vectors for branches {tuple(branches)}")
            vectors = {branch: pooled[:, k] for k, branch in enumerate(branches)}
        if not keep_tokens:
            return QueryEmbedding(vectors=vectors)
        return QueryEmbedding(vectors=vectors, tokens=packing.unpack(t), token_mask=packing.mask)


@dataclass(frozen=True)
class BackboneSizes:
    """The sizes every backbone shares, checked on construction (a ValueError names the bad one),
    and the encoders built from them.

    ``layer_args``: the keyword arguments every attention layer takes
    (:class:`~prvrlab.models.gmm.GMMBlock`, ``TransformerLayer``, ``TCGMMBlock``).
    """

    video_dim: int
    query_dim: int
    hidden_size: int
    num_heads: int
    dropout: float
    attention_dropout: float
    max_frames: int
    max_query_len: int

    def __post_init__(self) -> None:
        for name in ("video_dim", "query_dim", "hidden_size", "num_heads", "max_frames", "max_query_len"):
            check_positive_int(getattr(self, name), name)
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size={self.hidden_size} must be divisible by num_heads={self.num_heads}")
        check_probability(self.dropout, "dropout")
        check_probability(self.attention_dropout, "attention_dropout")

    @property
    def layer_args(self) -> dict[str, Any]:
        return {
            "hidden_size": self.hidden_size,
            "num_heads": self.num_heads,
            "dropout": self.dropout,
            "attention_dropout": self.attention_dropout,
        }

    def video_encoder(
        self, layer: Callable[[], nn.Module], *, num_layers: int = 1, pool: Callable[[], nn.Module] | None = None
    ) -> SequenceEncoder:
        """An encoder of (B, L, video_dim) clips or frames (up to ``max_frames``)."""
        args = self._encoder_args(layer, num_layers, pool)
        return SequenceEncoder(in_dim=self.video_dim, max_len=self.max_frames, **args)

    def query_encoder(
        self, layer: Callable[[], nn.Module], *, pool: Callable[[], nn.Module], num_layers: int = 1
    ) -> QueryEncoder:
        """An encoder of (Nq, Lq, query_dim) query tokens (up to ``max_query_len``) with a pooling head."""
        args = self._encoder_args(layer, num_layers, pool)
        return QueryEncoder(in_dim=self.query_dim, max_len=self.max_query_len, **args)

    def _encoder_args(
        self, layer: Callable[[], nn.Module], num_layers: int, pool: Callable[[], nn.Module] | None
    ) -> dict[str, Any]:
        return {
            "hidden_size": self.hidden_size,
            "dropout": self.dropout,
            "layer": layer,
            "num_layers": num_layers,
            "pool": pool,
        }


class PooledFrameBackbone(RetrievalModel):
    """A backbone with a clip-level branch, scored by the max cosine over a video's clips (or
    moments), and a frame branch pooled to one vector per video, scored by cosine; one query
    vector serves both (GMMFormer, the ICE base model).

    ``branches`` names the (clip-level, video-level) branches.  Subclasses build
    ``query`` (a :class:`QueryEncoder` with a (Nq, D) head) and ``frame`` (a
    :class:`SequenceEncoder` with a (B, D) head) and implement :meth:`encode_clips`.
    Per-frame embeddings are kept only when the ``frame_tokens`` capability is exposed.
    """

    branches: ClassVar[tuple[str, str]] = ("clip", "frame")
    query: QueryEncoder
    frame: SequenceEncoder

    def encode_clips(self, clips: Tensor) -> Tensor:
        """(B, Lc, Dv) clip features -> (B, Lc, D) clip-level embeddings."""
        raise NotImplementedError

    def keeps_frame_tokens(self) -> bool:
        """Whether :meth:`encode_videos` keeps the per-frame embeddings in ``extra`` (by default: when
        the ``frame_tokens`` capability is requested for the current mode)."""
        return self.exposes(FRAME_TOKENS)

    def encode_videos(self, clips: Tensor, frames: Tensor, frame_mask: Tensor) -> VideoEmbedding:
        """(B, Lc, Dv) clips, (B, Lf, Dv) frames, (B, Lf) mask -> clip (B, Lc, D), frame (B, D)."""
        clip = self.encode_clips(clips)  # (B, Lc, D)
        f, packing = self.frame.encode(frames, frame_mask)  # (Nf, D)
        extra = {}
        if self.keeps_frame_tokens():  # the frame branch is pooled: per-frame embeddings only on request
            extra = {"frame_tokens": packing.unpack(f), "frame_mask": packing.mask}  # (B, Lf, D), (B, Lf)
        return VideoEmbedding(clip=clip, frame=self.frame.pooled(f, packing), extra=extra)  # frame (B, D)

    def encode_queries(self, queries: Tensor, query_mask: Tensor) -> QueryEmbedding:
        """(Nq, Lq, Dq) tokens with (Nq, Lq) mask -> one (Nq, D) vector shared by both branches."""
        return self.query.embed(queries, query_mask, branches=self.branches, keep_tokens=self.keeps_word_tokens())

    score_elements = staticmethod(indexed_score_elements)

    def index_videos(self, video: VideoEmbedding) -> VideoEmbedding:
        """Adds the clips' norms (``extra["clip_norm"]``, :func:`~prvrlab.models.scoring.index_token_norms`)."""
        return index_token_norms(video, ("clip",))

    def score(
        self, query: QueryEmbedding, video: VideoEmbedding, *, with_logits: bool = False
    ) -> dict[str, BranchScores]:
        """Clip-level: max over clips of the cosine (logits: of the raw dot); video-level: cosine (logits: raw dot)."""
        if video.clip is None or video.frame is None or video.frame.dim() != 2:
            raise ValueError(f"{type(self).__name__}.score needs VideoEmbedding.clip and .frame (one vector per video)")
        clip_level, video_level = self.branches
        return {
            clip_level: max_scores(
                query.vectors[clip_level], video.clip, with_logits=with_logits, video_norm=indexed_norms(video, "clip")
            ),  # (Nq, Nv)
            video_level: vector_scores(query.vectors[video_level], video.frame, with_logits=with_logits),  # (Nq, Nv)
        }


def legacy_encoder_keys(
    name: str, *, layers: str, single_layer: bool = False, pool: str | None = None
) -> dict[str, str]:
    """Old -> new checkpoint key prefixes of the :class:`SequenceEncoder` ``name`` of a backbone
    whose encoder modules were its own attributes: ``<name>_proj``, ``<name>_pos``, the layers
    ``layers`` (a ModuleList, or the one layer itself with ``single_layer``) and the head ``pool``."""
    out = {
        f"{name}_proj.": f"{name}.proj.",
        f"{name}_pos.": f"{name}.pos.",
        f"{layers}.": f"{name}.layers.0." if single_layer else f"{name}.layers.",
    }
    if pool is not None:
        out[f"{pool}."] = f"{name}.pool."
    return out
