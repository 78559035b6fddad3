"""Column sums of bf16 matrices on CPU: ``column_sum.cpp`` built on first use, called through ctypes.

A linear layer's bias gradient is its output gradient summed over the rows.  ATen sums a wide bf16
matrix over dim 0 at a third of the memory's speed: v2's Q/K/V gradient (9,786, 9,216) took 25 ms, a
full copy of it 13.5.  The kernel reads each element once into float32 per-thread sums (added in thread
order) and rounds once, as ATen's sum does: the same values to summation order
(``tests/models/test_column_sum.py``).

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

_declare = native.void_functions(prvrlab_column_sum=[ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int])

# load(): the built library (built on first use) or None; unavailable_reason(): why None
load, unavailable_reason = native.loader(SOURCE, abi_symbol="prvrlab_column_sum_abi", abi=ABI, declare=_declare)


def column_sum(x: Tensor, out: Tensor | None = None) -> Tensor:
    """``x.sum(0)`` of a 2-D ``x`` (N, C) -> (C,) in x's dtype (into ``out`` if given, with ``torch.sum``'s
    handling of an ``out`` of another shape), through the kernel for a contiguous bf16 CPU ``x`` at least
    :data:`WIDE` columns wide, without autograd recording and with ``out`` (C,) or None.  (ATen is faster
    on narrow rows: (9,786, 384) 0.31 ms against the kernel's 0.50; on (9,786, 1,536) the kernel takes
    1.06 against 1.83.)"""
    if x.dim() != 2:
        raise ValueError(f"column_sum takes a 2-D tensor, got shape {tuple(x.shape)}")
    fused = (x.device.type == "cpu" and x.dtype == torch.bfloat16 and x.is_contiguous() and x.shape[1] >= WIDE
             and x.shape[0] > 0 and (out is None or tuple(out.shape) == (x.shape[1],))
             and not (torch.is_grad_enabled() and x.requires_grad) and load() is not None)
    if not fused:
        return x.sum(0) if out is None else torch.sum(x, 0, out=out)
    sums = torch.empty(x.shape[1], dtype=torch.float32)  # (C,)
    load().prvrlab_column_sum(x.data_ptr(), sums.data_ptr(), x.shape[0], x.shape[1], torch.get_num_threads())
    return sums.to(x.dtype) if out is None else out.copy_(sums)
