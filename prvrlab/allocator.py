"""How a computing process's host (CPU) memory is allocated: ``train.host_allocator``.

glibc's malloc serves every block above its mmap threshold (128 KiB, rising
to at most 32 MiB) with a fresh ``mmap`` and unmaps it at ``free``.  A CPU
training step or evaluation batch allocates and frees tensors of tens to
hundreds of MiB again and again, so every such tensor pays the page faults
and the kernel's zeroing of its pages on first touch, every time.

* ``keep`` (the default): malloc never maps a block of its own
  (``M_MMAP_MAX = 0``) and gives memory back to the system only when more
  than :data:`TRIM_BYTES` lie free at the top of its heap, so freed tensors'
  pages are reused by the next ones.  Measured by
  benchmarks/bench_allocator.py (2-core AMD EPYC, fp32, fresh process per
  run): GMMFormer training step 1.73x faster, GMMFormer v2 2.21x, an
  evaluation of 2,500 queries x 500 videos 1.36x (docs/performance.md, "The
  host allocator").  The price is peak resident memory: a freed block is reused
  only by blocks that fit in it (v2 at batch 128: 7.1 -> 8.9 GiB,
  3.30 -> 3.53 GiB with ``train.checkpoint_activations``).
* ``system``: glibc's default values.  A process that starts with it is
  untouched; one switched back from ``keep`` gets the default values, with
  glibc's dynamic mmap threshold fixed at its initial 128 KiB.

Results never depend on it.  It is process-wide, so it is applied only in
processes that compute (training workers, ``prvrlab eval``), never in a
driver.  Without glibc (macOS, musl) ``keep`` does nothing and says so by
returning False.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator
from typing import Literal, get_args

HostAllocator = Literal["keep", "system"]
HOST_ALLOCATORS: tuple[str, ...] = get_args(HostAllocator)
TRIM_BYTES = 1 << 30  # keep: free memory above this at the top of the heap goes back to the system

# mallopt(3) parameters and glibc's defaults
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4
_GLIBC_DEFAULTS = {_M_MMAP_MAX: 65536, _M_TRIM_THRESHOLD: 128 * 1024, _M_MMAP_THRESHOLD: 128 * 1024}
_KEEP = {_M_MMAP_MAX: 0, _M_TRIM_THRESHOLD: TRIM_BYTES}

_state: dict[str, str] = {"mode": "system"}  # what this process runs with


def _mallopt():
    """glibc's ``mallopt``, or None where the C library is not glibc."""
    try:
        libc = ctypes.CDLL(None)
        if not hasattr(libc, "gnu_get_libc_version"):
            return None
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt


def set_host_allocator(mode: str) -> bool:
    """Apply ``mode`` (``keep`` or ``system``, module docstring) to this process; True once it is in
    effect, False where it cannot be (no glibc: the process keeps the system's behaviour)."""
    if mode not in HOST_ALLOCATORS:
        raise ValueError(f"host allocator must be one of {', '.join(HOST_ALLOCATORS)}, got {mode!r}")
    if mode == _state["mode"]:
        return True
    mallopt = _mallopt()
    if mallopt is None:
        return mode == "system"
    settings = _KEEP if mode == "keep" else _GLIBC_DEFAULTS
    if not all(mallopt(param, value) == 1 for param, value in settings.items()):
        return False
    _state["mode"] = mode
    return True


def host_allocator() -> str:
    """The mode this process runs with (``system`` until :func:`set_host_allocator` changed it)."""
    return _state["mode"]


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (glibc >= 2.33)."""

    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def malloc_in_use() -> int | None:
    """Bytes malloc has handed out and not had back, from its heaps and as mapped blocks
    (``mallinfo2``: ``uordblks + hblkhd``, every arena), or None where the C library has no
    ``mallinfo2``: what live allocations and caches hold, freed blocks not counted (the resident set
    counts those under ``keep``)."""
    try:
        info = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    info.restype = _MallInfo2
    now = info()
    return int(now.uordblks + now.hblkhd)


def release_free_memory() -> bool:
    """Give the free memory of malloc's heaps back to the system (``malloc_trim(0)``) where this process
    runs with ``keep``; True if it did.  Called between phases whose blocks do not fit each other's freed
    holes (an evaluation's video encoding, query encoding and scoring): without it the freed pages of
    one phase stay resident under the next (an evaluation of TVR's test size: peak 1.75 -> 1.42 GiB)."""
    if _state["mode"] != "keep":
        return False
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


PRIMITIVE_CACHE_VARIABLE = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
EVAL_PRIMITIVE_CACHE = 16  # oneDNN primitives an evaluation-only process keeps (oneDNN's default: 1,024)
COMPUTATION_CACHE_VARIABLE = "LRU_CACHE_CAPACITY"  # PyTorch's own (ideep) cache of oneDNN matrix products
EVAL_COMPUTATION_CACHE = 16  # the computations an evaluation-only process keeps (PyTorch's default: 1,024)
TRAIN_PRIMITIVE_CACHE = 64  # a training process: above the distinct products of one step, forward and backward
TRAIN_COMPUTATION_CACHE = 64


def cap_primitive_caches(
    primitives: int = TRAIN_PRIMITIVE_CACHE, computations: int = TRAIN_COMPUTATION_CACHE
) -> tuple[str, ...]:
    """Cap oneDNN's primitive cache at ``primitives`` and PyTorch's cache of oneDNN computations at
    ``computations`` for the rest of this process, each unless the user set its variable; returns the
    variables set here.  Both are read at the process's first matrix product, so a process that has
    multiplied already keeps what it had.

    For training processes (``Trainer.setup``): every batch whose packed token counts differ makes new
    primitives, ~2 MiB each, and the defaults keep 1,024 of each kind.  bf16 on the 2-core AMD EPYC,
    batches of 32 TVR videos: over 30 steps GMMFormer's resident set grew 1.72 -> 2.52 GiB with the
    defaults and stayed at 1.49-1.55 GiB with 64 each; v2 2.78 -> 3.91 against 2.22-2.29 GiB; steps
    equally fast (session 39)."""
    caps = {PRIMITIVE_CACHE_VARIABLE: primitives, COMPUTATION_CACHE_VARIABLE: computations}
    set_here = tuple(name for name in caps if name not in os.environ)
    for name in set_here:
        os.environ[name] = str(int(caps[name]))
    return set_here


@contextlib.contextmanager
def primitive_cache_limit(
    capacity: int = EVAL_PRIMITIVE_CACHE, computations: int = EVAL_COMPUTATION_CACHE
) -> Iterator[tuple[str, ...]]:
    """Inside the block, oneDNN's cache of matrix-product primitives is capped at ``capacity`` and
    PyTorch's cache of the oneDNN computations it builds on them (``LRU_CACHE_CAPACITY``) at
    ``computations`` for this process, each unless the user set its variable; yields the variables set
    here.  Both are read once, at the process's first primitive, so the caps hold only where that
    comes inside the block (and then for the rest of the process); the environment is restored on exit,
    so processes started later do not inherit it.

    Each primitive holds its kernels and buffers (several MiB with AMX), and an evaluation makes new
    ones for every batch shape, which it never uses again: GMMFormer v2 on 500 validation videos in
    32 MiB batches kept 0.15 GiB more with oneDNN's 1,024 than with 64, at the same speed; GMMFormer at
    TVR's test size (~130 video-batch shapes) kept 0.28 GiB more with PyTorch's 1,024 computations than
    with 16 (peak 0.95 -> 0.67 GiB), and 16 primitives instead of 64 took another 0.03-0.07 GiB off, at
    the same speed.  16 holds the distinct products of one batch (GMMFormer's video encoder: 11), so a
    batch reuses its own.  For a process that evaluates once (``prvrlab eval``); a training process
    caps them at 64 (:func:`cap_primitive_caches`)."""
    set_here = cap_primitive_caches(capacity, computations)
    try:
        yield set_here
    finally:
        for name in set_here:
            os.environ.pop(name, None)
