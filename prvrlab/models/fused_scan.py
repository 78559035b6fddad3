"""The fused CPU selective scan: ``selective_scan.cpp`` built on first use, called through ctypes.

An exact scan in PyTorch operations streams (B, L, E, N) tensors through
memory several times; the fused kernel keeps each block of 16 channels'
N-dimensional states in registers and never materialises them (forward), and
recomputes one chunk's states at a time for the adjoint (backward; the
recurrence and its adjoint are in :mod:`prvrlab.models.mamba`).  Memory: the
inputs plus the states entering each chunk, (L / chunk) x (B, N, E), as the
chunked PyTorch scan.

Build: the system C++ compiler (``$CXX``, else ``c++``/``g++``/``clang++``)
with ``-O3 -march=native -ffast-math`` (vectorised ``exp`` through the C
library's vector math), no PyTorch headers (about 2 s), into
``$PRVRLAB_CACHE_DIR/scan`` (default ``~/.cache/prvrlab/scan``), one library
per source, compiler and CPU (``-march=native`` code must not run on another
CPU kind).  The library is written to a private temporary file and renamed
into place, so concurrent builds are safe; a library is loaded only when it
is owned by this user and writable by nobody else.  When no compiler is
found or the build fails, :func:`load` returns None and says why once
(:func:`unavailable_reason`); callers fall back to the PyTorch scan.

Threads: ``torch.get_num_threads()`` sequences at a time (C++ threads, one
range of sequences each), released from the GIL by ctypes.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import Tensor

from prvrlab.cache import cache_root

SOURCE = Path(__file__).with_name("selective_scan.cpp")
FLAGS = ("-O3", "-march=native", "-ffast-math", "-shared", "-fPIC", "-std=c++17", "-pthread")
ABI = 1  # prvrlab_scan_abi() of a library this module can call
_reason: list[str] = []


def cache_dir() -> Path:
    """Where built libraries live: ``scan`` in :func:`prvrlab.cache.cache_root`."""
    return cache_root() / "scan"


def _compiler() -> str | None:
    for name in filter(None, (os.environ.get("CXX"), "c++", "g++", "clang++")):
        path = shutil.which(name)
        if path:
            return path
    return None


def _cpu_identity() -> str:
    """The CPU kind -march=native compiles for: model name and feature flags where Linux lists them."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    keep = [ln for ln in lines if ln.startswith(("model name", "flags", "Features", "CPU part"))]
    return "\n".join(dict.fromkeys(keep)) or f"{platform.machine()} {platform.processor()}"


def _version(compiler: str) -> str:
    out = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60)
    return out.stdout.splitlines()[0] if out.stdout else compiler


def _trusted(path: Path) -> bool:
    """Owned by this user and writable by nobody else (a library is code: nothing else may plant one)."""
    st = path.stat()
    return (not hasattr(os, "getuid") or st.st_uid == os.getuid()) and not st.st_mode & 0o022


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if not _trusted(target.parent):
        raise OSError(f"{target.parent} is not owned by this user or is writable by others")
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        run = subprocess.run([compiler, *FLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=600)
        if run.returncode != 0:
            raise OSError(f"{compiler} failed: {(run.stderr or run.stdout).strip()[-2000:]}")
        os.chmod(tmp, 0o700)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.lru_cache(maxsize=None)
def load() -> ctypes.CDLL | None:
    """The built library (building it on first use), or None when it cannot be had (see the module)."""
    compiler = _compiler()
    if compiler is None:
        _reason.append("no C++ compiler found (set $CXX or install g++/clang++)")
        return None
    try:
        key = hashlib.sha256(
            "\0".join([SOURCE.read_text(), " ".join(FLAGS), _version(compiler), _cpu_identity()]).encode()
        ).hexdigest()[:16]
        target = cache_dir() / f"selective_scan-{key}.so"
        if not target.exists():
            _build(compiler, target)
        if not _trusted(target):
            raise OSError(f"{target} is not owned by this user or is writable by others; not loaded")
        lib = ctypes.CDLL(str(target))
        if lib.prvrlab_scan_abi() != ABI:
            raise OSError(f"{target}: unexpected interface version")
    except (OSError, subprocess.SubprocessError) as exc:
        _reason.append(str(exc))
        return None
    i64, f32p = ctypes.c_int64, ctypes.c_void_p
    lib.prvrlab_scan_forward.argtypes = [f32p] * 7 + [i64] * 5 + [ctypes.c_int]
    lib.prvrlab_scan_backward.argtypes = [f32p] * 12 + [i64] * 5 + [ctypes.c_int]
    return lib


def unavailable_reason() -> str | None:
    """Why :func:`load` returned None (None when it did not)."""
    return _reason[-1] if load() is None and _reason else None


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
