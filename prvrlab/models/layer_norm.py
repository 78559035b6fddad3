"""LayerNorm with a fused CPU backward: ``layer_norm.cpp`` built on first use, called through ctypes.

ATen's CPU backward of a bf16 LayerNorm with a float32 affine (what bf16 autocast runs) sums the
affine's gradients over the rows in a slow mixed-type pass: for v2's (9,786, 384) branch norms 2.2 ms
against 0.8 for the input gradient alone (float32: 1.2 ms in all), ~100 ms of a v2 bf16 training step.
The kernel computes the input gradient and both affine gradients in one pass over the rows, reading
each input once, with every sum in float32 (per-thread partial sums of the affine gradients, added in
thread order): 1.35 against 2.25 ms there.  The forward is ATen's (the same values, mean and 1/std); the
input gradient differs from ATen's by float32 summation order (one bf16 rounding in both), and the
affine gradients are float32 sums where ATen's mixed-type kernel loses bf16-sized amounts (on a
(37, 24) example, ATen's weight gradient was 0.11 off the float64 value, this one 1e-6;
``tests/models/test_layer_norm.py``).  Float32 inputs keep ATen's backward.  :func:`branch_layer_norm`
(GMMFormer v2's per-branch LayerNorms over (K, N, D)) also runs its forward in the kernel, writing all
branches into one output without a stack; its mean and 1/std are its own float32 ones.

Build: :mod:`prvrlab.models.native`; without it (:func:`unavailable_reason` says why), on other devices,
dtypes, or without autograd, :func:`layer_norm` is ``F.layer_norm``.  Threads: ``torch.get_num_threads()``
ranges of rows.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from prvrlab.models import native

SOURCE = Path(__file__).with_name("layer_norm.cpp")
ABI = 1  # prvrlab_layer_norm_abi() of a library this module can call
AFFINE_DTYPES = (torch.float32, torch.bfloat16)


_declare = native.void_functions(
    prvrlab_layer_norm_backward=[ctypes.c_void_p] * 8 + [ctypes.c_int64] * 2 + [ctypes.c_int],
    prvrlab_layer_norm_forward=[ctypes.c_void_p] * 6 + [ctypes.c_int64] * 3 + [ctypes.c_float, ctypes.c_int],
)

# load(): the built library (built on first use) or None; unavailable_reason(): why None
load, unavailable_reason = native.loader(SOURCE, abi_symbol="prvrlab_layer_norm_abi", abi=ABI, declare=_declare)


def _takes(x: Tensor, weight: Tensor | None, bias: Tensor | None) -> bool:
    """Whether the fused backward takes a LayerNorm of ``x`` with this affine: CPU tensors, ``x`` bf16 with at
    least one element, the affine float32 or bf16, autograd recording, the kernel built.  (Float32 keeps
    ATen's backward, which is as fast there: (9,786, 384) 1.3 ms.)"""
    params = [t for t in (weight, bias) if t is not None]
    return (
        torch.is_grad_enabled()
        and (x.requires_grad or any(t.requires_grad for t in params))
        and x.device.type == "cpu" and x.dtype == torch.bfloat16 and x.numel() > 0
        and all(t.device.type == "cpu" and t.dtype in AFFINE_DTYPES for t in params)
        and load() is not None
    )


def layer_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float = 1e-5) -> Tensor:
    """``F.layer_norm(x, (D,), weight, bias, eps)`` over the last dim of ``x`` (..., D), with the fused
    backward where it takes them (module docstring); ``weight`` and ``bias`` (D,) or None.  That backward
    is once differentiable: a second-order gradient through a bf16 LayerNorm raises (use ``F.layer_norm``
    there)."""
    if not _takes(x, weight, bias):
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    return _LayerNorm.apply(x, weight, bias, eps)


def _gradient_buffers(ctx, x: Tensor, affine: tuple[int, ...]) -> tuple[Tensor | None, ...]:
    """Empty (dx, dw, db) for the kernel's backward, None where that input needs no gradient: dx as ``x``,
    the affine's float32 of shape ``affine``."""
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    dx = torch.empty_like(x) if need_x else None
    dw = torch.empty(affine, dtype=torch.float32, device="cpu") if need_w else None
    db = torch.empty(affine, dtype=torch.float32, device="cpu") if need_b else None
    return dx, dw, db


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float) -> Tensor:
        D = x.shape[-1]
        x = x.contiguous()  # (..., D)
        out, mean, rstd = torch.ops.aten.native_layer_norm(x, [D], weight, bias, eps)  # (..., D), (..., 1) x 2
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.has_bias = bias is not None
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        x, weight, mean, rstd = ctx.saved_tensors
        D = x.shape[-1]
        N = x.numel() // D
        g = g.to(torch.bfloat16).contiguous()  # (..., D) as x
        dx, dw, db = _gradient_buffers(ctx, x, (D,))
        w = None if weight is None else weight.detach().float().contiguous()  # (D,)
        mean, rstd = mean.float().contiguous(), rstd.float().contiguous()  # (N,) each as (..., 1)
        load().prvrlab_layer_norm_backward(
            g.data_ptr(), x.data_ptr(), mean.data_ptr(), rstd.data_ptr(), 0 if w is None else w.data_ptr(),
            0 if dx is None else dx.data_ptr(), 0 if dw is None else dw.data_ptr(), 0 if db is None else db.data_ptr(),
            N, D, torch.get_num_threads())
        return (
            dx,
            None if dw is None else dw.to(weight.dtype),
            None if db is None else db.to(ctx.bias_dtype),
            None,
        )


def branch_layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-5) -> Tensor | None:
    """LayerNorm over the last dim of bf16 (K, N, D) with branch k's affine ``weight[k]``, ``bias[k]`` ((K, D)
    float32 or bf16), forward and backward in the kernel, written straight into (K, N, D) outputs (one
    LayerNorm per branch and a ``torch.stack``, forward and backward, made two more passes over them:
    v2's (8, 9,786, 384), forward + backward, 38 -> 27 ms).  The forward computes its own mean and 1/std in
    float32 (two passes over a row) where ATen's bf16 kernel keeps bf16 ones: outputs agree with ATen's to
    a bf16 rounding (``tests/models/test_layer_norm.py``; not for rows whose spread passes ~1e18, where its
    float32 sum of squares overflows to a NaN row while ATen's Welford sums stay finite, if already
    inaccurate).  None where it does not take them (the
    conditions of :func:`layer_norm`'s fused backward: autograd recording, a bf16 CPU ``x``; and ``x``
    3-D with (K, D) affines); the caller keeps the per-branch path."""
    if x.dim() != 3 or not _takes(x, weight, bias) or weight.shape != (x.shape[0], x.shape[2]) or bias.shape != weight.shape:
        return None
    return _BranchLayerNorm.apply(x, weight, bias, eps)


class _BranchLayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
        K, N, D = x.shape
        x = x.contiguous()  # (K, N, D)
        w, b = weight.detach().float().contiguous(), bias.detach().float().contiguous()  # (K, D) each
        out = torch.empty_like(x)
        mean = torch.empty(K, N, dtype=torch.float32, device="cpu")
        rstd = torch.empty(K, N, dtype=torch.float32, device="cpu")
        load().prvrlab_layer_norm_forward(x.data_ptr(), w.data_ptr(), b.data_ptr(), out.data_ptr(), mean.data_ptr(),
                                          rstd.data_ptr(), K * N, D, max(N, 1), eps, torch.get_num_threads())
        ctx.save_for_backward(x, w, mean, rstd)
        ctx.dtypes = (weight.dtype, bias.dtype)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        x, w, mean, rstd = ctx.saved_tensors
        K, N, D = x.shape
        g = g.to(torch.bfloat16).contiguous()  # (K, N, D)
        dx, dw, db = _gradient_buffers(ctx, x, (K, D))
        row, vec = N * D * x.element_size(), D * 4  # bytes of one branch's (N, D) bf16 block and (D,) float32 row
        for k in range(K):  # branch k's rows with its own affine and affine gradients
            load().prvrlab_layer_norm_backward(
                g.data_ptr() + k * row, x.data_ptr() + k * row, mean.data_ptr() + k * N * 4,
                rstd.data_ptr() + k * N * 4, w.data_ptr() + k * vec, 0 if dx is None else dx.data_ptr() + k * row,
                0 if dw is None else dw.data_ptr() + k * vec, 0 if db is None else db.data_ptr() + k * vec,
                N, D, torch.get_num_threads())
        return (
            dx,
            None if dw is None else dw.to(ctx.dtypes[0]),
            None if db is None else db.to(ctx.dtypes[1]),
            None,
        )


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` over the last dim, through :func:`layer_norm` (the fused CPU backward); the same
    parameters and state-dict keys."""

    def forward(self, x: Tensor) -> Tensor:
        if len(self.normalized_shape) != 1:
            return super().forward(x)
        return layer_norm(x, self.weight, self.bias, self.eps)
