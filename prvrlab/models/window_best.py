"""MS-SL's retrieval scores, fused: ``window_best.cpp`` built on first use, called through ctypes.

For every (query, video) pair the PyTorch path writes the query's score
against each of the video's P proposals ((Q, V, P) floats: 12.5 G at TVR's
test size), reads them again for the maximum and its index (the index
reduction alone runs ~5x slower than the maximum on CPUs), then gathers the
winning proposal's attended frame vector for each pair.  The kernel keeps
one pair's P scores in a buffer (each window's sum of the pair's Lc clip
dots accumulated left to right in float32, the windows of length k
extending those of length k - 1 by one item), and a video's scales and
attended vectors in cache while all queries pass.  Same scores as the
PyTorch path to float32 rounding, same first-maximum rule
(``tests/models/test_window_best.py``).

Build: :mod:`prvrlab.models.native`.  When it cannot be had, :func:`load`
returns None and :func:`unavailable_reason` says why; :class:`MSSL` then
keeps the PyTorch path.  Threads: ``torch.get_num_threads()`` ranges of
videos (C++ threads), released from the GIL by ctypes.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import Tensor

from prvrlab.models import native

SOURCE = Path(__file__).with_name("window_best.cpp")
ABI = 1  # prvrlab_window_abi() of a library this module can call


def _declare(lib: ctypes.CDLL) -> None:
    lib.prvrlab_window_best.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 5 + [ctypes.c_int]
    lib.prvrlab_window_best.restype = None


# load(): the built library (built on first use) or None; unavailable_reason(): why None
load, unavailable_reason = native.loader(SOURCE, abi_symbol="prvrlab_window_abi", abi=ABI, declare=_declare)


def num_proposals(length: int, max_window: int) -> int:
    """How many sliding windows of 1..max_window items fit in ``length`` items."""
    k = min(max_window, length)
    return k * length - k * (k - 1) // 2


def usable(*tensors: Tensor | None) -> bool:
    """Whether the kernel can take these inputs: built, every tensor a finite float32 CPU tensor (the
    kernel is compiled with -ffast-math, which assumes finite values)."""
    present = [t for t in tensors if t is not None]
    if any(t.device.type != "cpu" or t.dtype != torch.float32 for t in present):
        return False
    return load() is not None and all(bool(torch.isfinite(t).all()) for t in present)


def window_best(
    dots: Tensor, scale: Tensor, max_window: int, unit: Tensor | None = None, q_frame: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """(Q, V, L) clip dots, (V, P) proposal scales [, (V, P, D) unit attended vectors, (Q, D) frame query
    vectors] -> ``top`` (Q, V): max over proposals of window sum x scale, ``best`` (Q, V) int64: its first
    index, ``frame_dot`` (Q, V): ``q_frame . unit[v, best]`` (None without ``unit``).

    CPU tensors; ``dots``, ``scale`` and ``q_frame`` float32, ``unit`` any float dtype, read as float32
    (as the PyTorch path's ``.float()``); at least one proposal (``max_window`` >= 1 and L >= 1: the
    maximum over none is undefined, as ``torch.max`` over an empty dim).  Else ValueError."""
    lib = load()
    if lib is None:
        raise RuntimeError(f"the fused window kernel is unavailable: {unavailable_reason()}")
    named = {"dots": dots, "scale": scale, "unit": unit, "q_frame": q_frame}
    for name, t in named.items():
        if t is None:
            continue
        if t.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU tensor, got one on {t.device}")
        if name == "unit" and not t.is_floating_point():
            raise ValueError(f"unit must be a floating-point tensor, got {t.dtype}")
        if name != "unit" and t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32, got {t.dtype}")
    if dots.dim() != 3:
        raise ValueError(f"dots must be (Q, V, L), got {tuple(dots.shape)}")
    nq, nv, length = dots.shape
    if int(max_window) < 1 or length < 1:
        raise ValueError(f"window_best needs at least one proposal: max_window={max_window} and L={length} "
                         "must both be >= 1")
    dim = 0 if unit is None else unit.shape[-1]
    expected = (nv, num_proposals(length, int(max_window)))
    if tuple(scale.shape) != expected:
        raise ValueError(f"scale must be (V, P) = {expected}, got {tuple(scale.shape)}")
    if unit is not None and (q_frame is None or unit.dim() != 3 or unit.shape[:2] != scale.shape
                             or q_frame.shape != (nq, dim)):
        raise ValueError("unit must be (V, P, D) with q_frame (Q, D)")
    dots, scale = dots.contiguous(), scale.contiguous()
    unit = None if unit is None else unit.float().contiguous()
    q_frame = None if q_frame is None else q_frame.contiguous()
    top = dots.new_empty((nq, nv))
    best = torch.empty((nq, nv), dtype=torch.int64, device="cpu")
    frame_dot = None if unit is None else dots.new_empty((nq, nv))

    def ptr(t: Tensor | None) -> int | None:
        return None if t is None else t.data_ptr()

    lib.prvrlab_window_best(ptr(dots), ptr(scale), ptr(unit), ptr(q_frame), ptr(top), ptr(best), ptr(frame_dot),
                            nq, nv, length, int(max_window), dim, torch.get_num_threads())
    return top, best, frame_dot
