"""Column sums of bf16 matrices on CPU: ``column_sum.cpp`` built on first use, called through ctypes.

A linear layer's bias gradient is its output gradient summed over the rows.  ATen sums a wide bf16
matrix over dim 0 at a third of the memory's speed: v2's Q/K/V gradient (9,786, 9,216) took 25 ms, a
full copy of it 13.5.  The kernel reads each element once into float32 per-thread sums (added in thread
order) and rounds once, as ATen's sum does: the same values to summation order
(``tests/models/test_column_sum.py``).

:func:`relu_grad_column_sum` also applies a ReLU's backward to the gradient, in place, in the same pass:
GMMFormer v2's branch FFN, (9,786, 1,536) bf16, ``threshold_backward`` then the column sums 7.5 -> 5.4 ms.

Build: :mod:`prvrlab.models.native`; without it (:func:`unavailable_reason` says why), for other dtypes,
layouts or devices :func:`column_sum` is ``x.sum(0)``.  Threads: ``torch.get_num_threads()`` ranges of rows.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import Tensor

from prvrlab.models import native

SOURCE = Path(__file__).with_name("column_sum.cpp")
ABI = 1  # prvrlab_column_sum_abi() of a library this module can call
WIDE = 1024  # columns from which the kernel runs

_declare = native.void_functions(
    prvrlab_column_sum=[ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int],
    prvrlab_relu_grad_column_sum=[ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_int],
)

# load(): the built library (built on first use) or None; unavailable_reason(): why None
load, unavailable_reason = native.loader(SOURCE, abi_symbol="prvrlab_column_sum_abi", abi=ABI, declare=_declare)


def _kernel_takes(x: Tensor, out: Tensor | None) -> bool:
    """A contiguous bf16 CPU (N, C) ``x``, N > 0 and C >= :data:`WIDE`, not recording autograd, ``out`` (C,) or
    None, the kernel built."""
    return (x.device.type == "cpu" and x.dtype == torch.bfloat16 and x.is_contiguous() and x.shape[1] >= WIDE
            and x.shape[0] > 0 and (out is None or tuple(out.shape) == (x.shape[1],))
            and not (torch.is_grad_enabled() and x.requires_grad) and load() is not None)


def column_sum(x: Tensor, out: Tensor | None = None) -> Tensor:
    """``x.sum(0)`` of a 2-D ``x`` (N, C) -> (C,) in x's dtype (into ``out`` if given, with ``torch.sum``'s
    handling of an ``out`` of another shape), through the kernel for a contiguous bf16 CPU ``x`` at least
    :data:`WIDE` columns wide, without autograd recording and with ``out`` (C,) or None.  (ATen is faster
    on narrow rows: (9,786, 384) 0.31 ms against the kernel's 0.50; on (9,786, 1,536) the kernel takes
    1.06 against 1.83.)"""
    if x.dim() != 2:
        raise ValueError(f"column_sum takes a 2-D tensor, got shape {tuple(x.shape)}")
    if not _kernel_takes(x, out):
        return x.sum(0) if out is None else torch.sum(x, 0, out=out)
    sums = torch.empty(x.shape[1], dtype=torch.float32, device="cpu")  # (C,)
    load().prvrlab_column_sum(x.data_ptr(), sums.data_ptr(), x.shape[0], x.shape[1], torch.get_num_threads())
    return sums.to(x.dtype) if out is None else out.copy_(sums)


def relu_grad_column_sum(g: Tensor, h: Tensor, out: Tensor) -> Tensor:
    """``g = threshold_backward(g, h, 0)`` (g where h > 0 or h is NaN, else 0) and ``out = g.sum(0)`` for 2-D
    (N, C) ``g`` and ``h`` (``h``: the ReLU's output or anything positive exactly where it passed), ``out``
    (C,); returns the new ``g``.  In place and in one pass on a bf16 CPU ``g`` that :func:`column_sum`'s
    kernel takes, with ``h`` alike; else ATen's two passes (``g`` then not modified)."""
    fused = (g.dim() == h.dim() == 2 and g.shape == h.shape and h.dtype == g.dtype and h.device.type == "cpu"
             and h.is_contiguous() and _kernel_takes(g, out))
    if not fused:
        g = torch.ops.aten.threshold_backward(g, h, 0)
        column_sum(g, out=out)
        return g
    sums = torch.empty(g.shape[1], dtype=torch.float32, device="cpu")  # (C,)
    load().prvrlab_relu_grad_column_sum(g.data_ptr(), h.data_ptr(), sums.data_ptr(), g.shape[0], g.shape[1],
                                        torch.get_num_threads())
    torch.autograd.graph.increment_version(g)  # an in-place write, as threshold_backward_ would count it
    out.copy_(sums)
    return g
