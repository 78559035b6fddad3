"""The fused CPU selective scan: ``selective_scan.cpp`` built on first use, called through ctypes.

An exact scan in PyTorch operations streams (B, L, E, N) tensors through
memory several times; the fused kernel keeps each block of 16 channels'
N-dimensional states in registers and never materialises them (forward), and
recomputes one chunk's states at a time for the adjoint (backward; the
recurrence and its adjoint are in :mod:`prvrlab.models.mamba`).  Memory: the
inputs plus the states entering each chunk, (L / chunk) x (B, N, E), as the
chunked PyTorch scan.

Build: :mod:`prvrlab.models.native` (the system C++ compiler, ``-O3
-march=native -ffast-math``, vectorised ``exp`` through the C library's
vector math, no PyTorch headers: about 2 s; cached per source, compiler and
CPU; loaded only from a private folder).  When it cannot be had, :func:`load`
returns None and says why once (:func:`unavailable_reason`); callers fall
back to the PyTorch scan.

Threads: ``torch.get_num_threads()`` sequences at a time (C++ threads, one
range of sequences each), released from the GIL by ctypes.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import Tensor

from prvrlab.models import native

SOURCE = Path(__file__).with_name("selective_scan.cpp")
ABI = 1  # prvrlab_scan_abi() of a library this module can call


def _declare(lib: ctypes.CDLL) -> None:
    i64, f32p = ctypes.c_int64, ctypes.c_void_p
    lib.prvrlab_scan_forward.argtypes = [f32p] * 7 + [i64] * 5 + [ctypes.c_int]
    lib.prvrlab_scan_backward.argtypes = [f32p] * 12 + [i64] * 5 + [ctypes.c_int]


# load(): the built library (built on first use) or None; unavailable_reason(): why None
load, unavailable_reason = native.loader(SOURCE, abi_symbol="prvrlab_scan_abi", abi=ABI, declare=_declare)


def _ptr(t: Tensor) -> int:
    return t.data_ptr()


class FusedScan(torch.autograd.Function):
    """The scan without the skip through the fused kernel: float32 CPU tensors, (B, L, E) x and delta,
    (E, N) A, (B, L, N) B and C -> (B, L, E) y."""

    @staticmethod
    def forward(ctx, x: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk: int) -> Tensor:
        lib = load()
        batch, length, channels = x.shape
        state = A.shape[1]
        x, delta, B, C = (t.contiguous() for t in (x, delta, B, C))
        At = A.t().contiguous()  # (N, E)
        y = torch.empty_like(x)
        entering = x.new_empty(-(-length // chunk), batch, state, channels)  # (K, B, N, E)
        threads = torch.get_num_threads()
        lib.prvrlab_scan_forward(_ptr(x), _ptr(delta), _ptr(At), _ptr(B), _ptr(C), _ptr(y), _ptr(entering),
                                 batch, length, channels, state, chunk, threads)
        ctx.save_for_backward(x, delta, At, B, C, entering)
        ctx.chunk, ctx.threads = chunk, threads
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy: Tensor):
        x, delta, At, B, C, entering = ctx.saved_tensors
        batch, length, channels = x.shape
        state = At.shape[0]
        dy = dy.contiguous()
        dx, ddelta, dB, dC = (torch.empty_like(t) for t in (x, delta, B, C))
        threads = max(1, min(ctx.threads, batch))
        dAt = x.new_zeros(threads, state, channels)  # one partial sum per thread
        load().prvrlab_scan_backward(_ptr(x), _ptr(delta), _ptr(At), _ptr(B), _ptr(C), _ptr(entering), _ptr(dy),
                                     _ptr(dx), _ptr(ddelta), _ptr(dAt), _ptr(dB), _ptr(dC),
                                     batch, length, channels, state, ctx.chunk, threads)
        return dx, ddelta, dAt.sum(0).t(), dB, dC, None
