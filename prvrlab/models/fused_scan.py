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

from prvrlab.checks import check_positive_int
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


def _full(t: Tensor, shape: tuple[int, ...], name: str) -> Tensor:
    """``t`` as a contiguous float32 CPU tensor of ``shape``, expanded from a broadcastable shape (as the
    PyTorch scan's products broadcast it); ValueError naming ``name`` otherwise."""
    if t.device.type != "cpu" or t.dtype != torch.float32:
        raise ValueError(f"{name} must be a float32 CPU tensor, got {t.dtype} on {t.device}")
    if t.dim() > len(shape) or any(s not in (1, f) for s, f in zip(reversed(t.shape), reversed(shape))):
        raise ValueError(f"{name} must be {shape} or broadcast to it, got {tuple(t.shape)}")
    return t.expand(shape).contiguous()


class FusedScan(torch.autograd.Function):
    """The scan without the skip through the fused kernel: float32 CPU tensors, (B, L, E) x and delta,
    (E, N) A, (B, L, N) B and C -> (B, L, E) y; ``delta``, ``A``, ``B`` and ``C`` may broadcast to those
    shapes (expanded here; their gradients summed back), anything else raises ValueError.  ``chunk``: a
    positive int, clamped to L as in :func:`~prvrlab.models.mamba.selective_scan_chunked`."""

    @staticmethod
    def forward(ctx, x: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk: int) -> Tensor:
        lib = load()
        check_positive_int(chunk, "chunk")
        for name, t, dims, shape in (("x", x, 3, "(B, L, E)"), ("A", A, 2, "(E, N)")):
            if t.dim() != dims:
                raise ValueError(f"{name} must be {shape}, got {tuple(t.shape)}")
        batch, length, channels = x.shape
        state = A.shape[1]
        ctx.shapes = tuple(t.shape for t in (delta, A, B, C))
        x = _full(x, (batch, length, channels), "x")
        delta = _full(delta, (batch, length, channels), "delta")  # (B, L, E)
        A = _full(A, (channels, state), "A")  # (E, N)
        B = _full(B, (batch, length, state), "B")  # (B, L, N)
        C = _full(C, (batch, length, state), "C")  # (B, L, N)
        chunk = max(1, min(chunk, length))  # scratch of chunk x N x 16 floats per thread in the backward
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
        grads = (ddelta, dAt.sum(0).t(), dB, dC)
        return dx, *(g.sum_to_size(shape) for g, shape in zip(grads, ctx.shapes)), None
