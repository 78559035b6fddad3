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
ROW_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)  # rows' dtypes, read as int64


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


def _dense_tail(t: Tensor, n: int) -> bool:
    """Whether the last ``n`` dims of ``t`` are laid out as a contiguous block (size-1 dims ignored)."""
    expected = 1
    for size, stride in zip(reversed(t.shape[-n:]), reversed(t.stride()[-n:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _check_cpu(t: Tensor, name: str) -> None:
    """ValueError naming ``name`` unless ``t`` is on the CPU (the kernel reads host pointers)."""
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be a CPU tensor, got one on {t.device}")


def _checked_window(window: Tensor | float, shape: tuple[int, ...]) -> Tensor | float:
    """``window`` as the kernel reads it: a float, or a float32 (1 or B, 1 or K, 1, L, L) CPU tensor whose
    (L, L) blocks are contiguous (copied when they are not)."""
    if not isinstance(window, Tensor):
        return float(window)
    B, K, _, L, _ = shape
    _check_cpu(window, "window")
    if window.dtype != torch.float32:
        raise ValueError(f"window must be float32, got {window.dtype}")
    broadcast = window.dim() == 5 and window.shape[0] in (1, B) and window.shape[1] in (1, K)
    if not broadcast or tuple(window.shape[2:]) != (1, L, L):
        raise ValueError(f"window must be (1 or B, 1 or K, 1, L, L) with (B, K, L) = {(B, K, L)}, "
                         f"got {tuple(window.shape)}")
    return window if _dense_tail(window, 2) else window.contiguous()


def _checked_draw(draw: Tensor | None, p: float, shape: tuple[int, ...]) -> Tensor | None:
    """``draw`` as the kernel reads it: an int16 CPU tensor of the logits' shape whose (H, L, L) blocks are
    contiguous (copied when they are not; batch and branch strides are free), for a ``p`` it can express."""
    if draw is None:
        return None
    _check_cpu(draw, "draw")
    if draw.dtype != torch.int16:
        raise ValueError(f"draw must be an int16 dropout_draw, got {draw.dtype}")
    if tuple(draw.shape) != shape:
        raise ValueError(f"draw must have the logits' shape {shape}, got {tuple(draw.shape)}")
    if not (0.0 <= p and takes(p)):
        raise ValueError(f"p must be in [0, 1 - 2^-17) with a draw, got {p!r}")
    return draw if _dense_tail(draw, 3) else draw.contiguous()


def _window_args(window: Tensor | float) -> tuple[int, int, int, float]:
    """(pointer, batch stride, branch stride, scalar scale) of a float or a checked window (stride 0 on a
    broadcast dim)."""
    if not isinstance(window, Tensor):
        return 0, 0, 0, float(window)
    batch_stride = 0 if window.shape[0] == 1 else window.stride(0)
    branch_stride = 0 if window.shape[1] == 1 else window.stride(1)
    return window.data_ptr(), batch_stride, branch_stride, 1.0


def _draw_args(draw: Tensor | None, p: float, dtype: torch.dtype) -> tuple[int, int, int, int, float]:
    """(pointer, batch stride, branch stride, threshold, keep scale) of a checked draw; the keep scale in
    ``dtype``, as :func:`~prvrlab.models.blocks.mask_from_draw` multiplies."""
    if draw is None:
        return 0, 0, 0, 0, 1.0
    keep = torch.tensor(1.0 / (1.0 - p), dtype=dtype).item()
    return draw.data_ptr(), draw.stride(0), draw.stride(1), draw_threshold(p), keep


class WindowSoftmax(torch.autograd.Function):
    """(B, K, H, L, L) contiguous float32 or bf16 CPU logits -> (B, K, H, L, L) weights
    ``softmax(window * logits)`` over the keys of ``keys`` (B, L) bool (None: all), zeros on query rows at
    or beyond ``rows`` (B,) integers (None: none), times the dropout mask of ``draw``
    (:func:`prvrlab.models.blocks.dropout_draw`, (B, K, H, L, L) int16, any batch and branch strides;
    None: no dropout) for ``p``.  ``window``: a float scale, or float32 (1 or B, 1 or K, 1, L, L) windows
    with the scale folded in.  Inputs of another dtype, device or shape raise ValueError; a window or draw
    whose (L, L) / (H, L, L) blocks are not contiguous is copied first.

    Non-finite products follow GaussianAttention's PyTorch path (``window * logits`` plus ``finfo.min / 2``
    on padded keys): NaN or ``+inf`` anywhere in a row makes the row NaN, a ``-inf`` key weighs 0, and a row
    whose real keys are all ``-inf`` (or that has none) is uniform over its keys that are not ``-inf``, NaN
    when none is left; with dropout, a dropped NaN stays NaN (forward and backward), as the mask multiply
    gives.  This holds for products of magnitude below ``finfo.max / 2`` (~1.7e38); beyond, PyTorch's
    finite bias runs out or its bf16 rounding overflows and the two differ: a real key's finite product
    below ``finfo.min / 2`` still outweighs every padded key here, a padded key's product above
    ``finfo.max / 2`` gets no weight here (all of it in PyTorch), a padded product below ``finfo.min / 2``
    stays in the uniform fallback here, and a bf16 product the kernel holds as a finite float32 can be
    ``inf`` (a NaN row) in PyTorch."""

    @staticmethod
    def forward(ctx, logits: Tensor, window: Tensor | float, keys: Tensor | None, rows: Tensor | None,
                draw: Tensor | None, p: float):
        _check_cpu(logits, "logits")
        square = logits.dim() == 5 and logits.shape[3] == logits.shape[4]
        if logits.dtype not in DTYPES or not square or not logits.is_contiguous():
            raise ValueError(f"logits must be contiguous float32 or bf16 (B, K, H, L, L), got {logits.dtype} "
                             f"{tuple(logits.shape)} with strides {logits.stride()}")
        B, K, H, L, _ = logits.shape
        window = _checked_window(window, tuple(logits.shape))
        draw = _checked_draw(draw, p, tuple(logits.shape))
        if keys is not None:
            _check_cpu(keys, "keys")
            if keys.dtype != torch.bool or tuple(keys.shape) != (B, L):
                raise ValueError(f"keys must be (B, L) = {(B, L)} bool, got {keys.dtype} {tuple(keys.shape)}")
            keys = keys.to(torch.uint8).contiguous()  # (B, L)
        if rows is not None:
            _check_cpu(rows, "rows")
            if rows.dtype not in ROW_DTYPES or tuple(rows.shape) != (B,):
                raise ValueError(f"rows must be (B,) = {(B,)} integers, got {rows.dtype} {tuple(rows.shape)}")
            rows = rows.to(torch.int64).contiguous()  # (B,)
        probs = torch.empty_like(logits)
        dropped = None if draw is None else torch.empty_like(logits)
        w, w_b, w_k, scale = _window_args(window)
        d, d_b, d_k, threshold, keep = _draw_args(draw, p, logits.dtype)
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
