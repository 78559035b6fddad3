"""GMMFormer's windowed attention weights, fused on CPU: ``window_softmax.cpp`` built on first use, called
through ctypes.

PyTorch computes ``softmax(G * S + key bias) * dropout mask`` in four passes
forward (window multiply-add, softmax, mask from the draw, multiply) and
three backward, each streaming (B, K, H, L, L) tensors through memory; in
bf16 on a CPU with matrix units those passes, not the products around them,
are most of the attention's time.  The kernel reads each logit once and
writes the weights (and the dropped weights) once; the backward reads the
gradient, the weights and the draw once.  It also skips padded query rows
(zeros there; their outputs are never read) and keeps every row's
arithmetic in float32, rounding once on output: bf16 results agree with
PyTorch's to bf16 rounding, float32 ones to 1e-6
(``tests/models/test_window_softmax.py``).

Build: :mod:`prvrlab.models.native`.  When it cannot be had, :func:`load`
returns None and :func:`unavailable_reason` says why; the attention then
keeps the PyTorch passes.  Threads: ``torch.get_num_threads()`` ranges of
matrices (C++ threads), released from the GIL by ctypes.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import Tensor

from prvrlab.models import native
from prvrlab.models.blocks import draw_threshold

SOURCE = Path(__file__).with_name("window_softmax.cpp")
ABI = 1  # prvrlab_softmax_abi() of a library this module can call
DTYPES = (torch.float32, torch.bfloat16)


def _declare(lib: ctypes.CDLL) -> None:
    ptr, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float
    lib.prvrlab_softmax_forward.argtypes = [ptr] * 4 + [i64, i64, f32, ptr, ptr, ptr, i64, i64, i32, f32] + [
        i64] * 4 + [ctypes.c_int] * 2
    lib.prvrlab_softmax_forward.restype = None
    lib.prvrlab_softmax_backward.argtypes = [ptr] * 4 + [i64, i64, f32, ptr, ptr, i64, i64, i32, f32] + [
        i64] * 4 + [ctypes.c_int] * 2
    lib.prvrlab_softmax_backward.restype = None


# load(): the built library (built on first use) or None; unavailable_reason(): why None
load, unavailable_reason = native.loader(SOURCE, abi_symbol="prvrlab_softmax_abi", abi=ABI, declare=_declare)


def usable(logits: Tensor) -> bool:
    """Whether the kernel takes these (B, K, H, L, L) logits: a contiguous float32 or bf16 CPU tensor, and built."""
    return (logits.device.type == "cpu" and logits.dtype in DTYPES and logits.dim() == 5 and logits.is_contiguous()
            and load() is not None)


def takes(p: float) -> bool:
    """Whether the kernel's int16 threshold can express dropout probability ``p`` (all p < 1 - 2^-17)."""
    return draw_threshold(p) <= 32767


def _window_args(window: Tensor | float) -> tuple[int, int, int, float]:
    """(pointer, batch stride, branch stride, scalar scale) of a float or a float32 (1 or B, K, 1, L, L) window."""
    if not isinstance(window, Tensor):
        return 0, 0, 0, float(window)
    L = window.shape[-1]
    batch_stride = 0 if window.shape[0] == 1 else window.stride(0)
    return window.data_ptr(), batch_stride, L * L, 1.0


def _draw_args(draw: Tensor | None, p: float, dtype: torch.dtype) -> tuple[int, int, int, int, float]:
    """(pointer, batch stride, branch stride, threshold, keep scale) of a (B, K, H, L, L) int16 draw; the
    keep scale in ``dtype``, as :func:`~prvrlab.models.blocks.mask_from_draw` multiplies."""
    if draw is None:
        return 0, 0, 0, 0, 1.0
    keep = torch.tensor(1.0 / (1.0 - p), dtype=dtype).item()
    return draw.data_ptr(), draw.stride(0), draw.stride(1), draw_threshold(p), keep


class WindowSoftmax(torch.autograd.Function):
    """(B, K, H, L, L) logits -> (B, K, H, L, L) weights ``softmax(window * logits)`` over the keys of
    ``keys`` (B, L) bool (None: all), zeros on query rows at or beyond ``rows`` (B,) (None: none), times
    the dropout mask of ``draw`` (:func:`prvrlab.models.blocks.dropout_draw`, (B, K, H, L, L) int16 with
    contiguous (H, L, L) blocks; None: no dropout).  ``window``: a float scale, or float32
    (1 or B, K, 1, L, L) windows with the scale folded in."""

    @staticmethod
    def forward(ctx, logits: Tensor, window: Tensor | float, keys: Tensor | None, rows: Tensor | None,
                draw: Tensor | None, p: float):
        B, K, H, L, _ = logits.shape
        probs = torch.empty_like(logits)
        dropped = None if draw is None else torch.empty_like(logits)
        w, w_b, w_k, scale = _window_args(window)
        d, d_b, d_k, threshold, keep = _draw_args(draw, p, logits.dtype)
        keys = None if keys is None else keys.to(torch.uint8).contiguous()
        rows = None if rows is None else rows.to(torch.int64).contiguous()
        load().prvrlab_softmax_forward(
            logits.data_ptr(), probs.data_ptr(), 0 if dropped is None else dropped.data_ptr(), w, w_b, w_k, scale,
            0 if keys is None else keys.data_ptr(), 0 if rows is None else rows.data_ptr(), d, d_b, d_k, threshold,
            keep, B, K, H, L, int(logits.dtype == torch.bfloat16), torch.get_num_threads())
        ctx.save_for_backward(probs, *(t for t in (window, rows, draw) if isinstance(t, Tensor)))
        ctx.present = tuple(isinstance(t, Tensor) for t in (window, rows, draw))
        ctx.scale, ctx.keep, ctx.threshold = scale, keep, threshold
        return probs if dropped is None else dropped

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        probs, *rest = ctx.saved_tensors
        window, rows, draw = (rest.pop(0) if present else None for present in ctx.present)
        B, K, H, L, _ = probs.shape
        grad = grad.to(probs.dtype).contiguous()
        out = torch.empty_like(probs)
        w, w_b, w_k, _ = _window_args(ctx.scale if window is None else window)
        d, d_b, d_k = (0, 0, 0) if draw is None else (draw.data_ptr(), draw.stride(0), draw.stride(1))
        load().prvrlab_softmax_backward(
            probs.data_ptr(), grad.data_ptr(), out.data_ptr(), w, w_b, w_k, ctx.scale,
            0 if rows is None else rows.data_ptr(), d, d_b, d_k, ctx.threshold, ctx.keep, B, K, H, L,
            int(probs.dtype == torch.bfloat16), torch.get_num_threads())
        return out, None, None, None, None, None
