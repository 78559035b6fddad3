"""Small C++ kernels (``*.cpp`` beside this module) built on first use and loaded through ctypes.

Build: the system C++ compiler (``$CXX``, else ``c++``/``g++``/``clang++``)
with ``-O3 -march=native -ffast-math`` and linked without ``-ffast-math`` (which would
set flush-to-zero for the whole thread that loads it), no PyTorch headers (a few seconds);
a kernel that must reproduce PyTorch's IEEE arithmetic and NaN rules exactly is built with
``fast_math=False`` (``-ffp-contract=off`` instead, no ``-ffast-math``),
into ``$PRVRLAB_CACHE_DIR/native`` (default ``~/.cache/prvrlab/native``), one
library per source (with the headers beside it that it includes), flags,
compiler and CPU (``-march=native`` code must not run on another CPU kind).
A library is written to a private temporary file and renamed into place, so
concurrent builds are safe, and it is loaded only when it is owned by this
user and writable by nobody else (a library is code: nothing else may plant
one).  Every failure (no compiler, a failed
build, an untrusted file, another interface version) raises
:class:`Unavailable` with the reason; callers fall back to PyTorch.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

from prvrlab.cache import cache_root

_LOCAL_INCLUDE = re.compile(r'^#include "([A-Za-z0-9_]+\.h)"', re.MULTILINE)  # headers beside a source: in its key
# Compiled with -ffast-math, linked without it: at link time it adds crtfastmath.o, whose constructor sets
# flush-to-zero and denormals-are-zero on the loading thread, so loading a kernel changed torch's own
# arithmetic on that thread (1e-39 * 1.0 became 0) and made results depend on which thread ran an op.
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fPIC", "-std=c++17", "-pthread")
# IEEE arithmetic as PyTorch's (fast_math=False): no reassociation, reciprocals or finite-only assumptions, no fused
# multiply-adds but the ones a kernel writes (each product rounded as ATen's own element-wise ops round it); no errno
# from the maths functions (which changes no result, and lets a loop that takes a square root vectorise)
EXACT_COMPILE_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-std=c++17", "-pthread")
LINK_FLAGS = ("-shared", "-pthread")


# Where the CPU has AVX512-BF16 (Sapphire Rapids and later, Zen 4), whose 512-bit units run at full clock: the
# compiler's 512-bit loops instead of its default 256-bit ones (measured on an AMX Xeon, 2 threads: the fused
# window softmax's forward 24 -> 20 ms, the winners 9.5 -> 5.5 ms, branch LayerNorm forward + backward 28 -> 25
# ms).  Older AVX-512 CPUs keep 256 bits: their 512-bit instructions lower the clock.
WIDE_VECTOR_FLAGS = ("-mprefer-vector-width=512",)


def _compile_flags(fast_math: bool) -> tuple[str, ...]:
    flags = COMPILE_FLAGS if fast_math else EXACT_COMPILE_FLAGS
    return (*flags, *WIDE_VECTOR_FLAGS) if _wide_vectors() else flags


@functools.lru_cache(maxsize=None)
def _wide_vectors() -> bool:
    """Whether this CPU lists ``avx512_bf16`` (Linux /proc/cpuinfo flags)."""
    return re.search(r"\bavx512_bf16\b", _cpu_identity()) is not None


def _flags(fast_math: bool) -> tuple[str, ...]:
    """Both steps' flags, as they enter the cache key."""
    return (*_compile_flags(fast_math), "-c", "|", *LINK_FLAGS)



class Unavailable(OSError):
    """A kernel library could not be built or loaded (the message says why)."""


def cache_dir() -> Path:
    """Where built libraries live: ``native`` in :func:`prvrlab.cache.cache_root`."""
    return cache_root() / "native"


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
    """Owned by this user and writable by nobody else."""
    st = path.stat()
    return (not hasattr(os, "getuid") or st.st_uid == os.getuid()) and not st.st_mode & 0o022


def _build(compiler: str, source: Path, target: Path, fast_math: bool = True) -> None:
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if not _trusted(target.parent):
        raise Unavailable(f"{target.parent} is not owned by this user or is writable by others")
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    obj = tmp[: -len(".so")] + ".o"
    try:
        for step in ([*_compile_flags(fast_math), "-c", "-o", obj, str(source)], [*LINK_FLAGS, "-o", tmp, obj]):
            run = subprocess.run([compiler, *step], capture_output=True, text=True, timeout=600)
            if run.returncode != 0:
                raise Unavailable(f"{compiler} failed: {(run.stderr or run.stdout).strip()[-2000:]}")
        os.chmod(tmp, 0o700)
        os.replace(tmp, target)
    finally:
        for path in (tmp, obj):
            if os.path.exists(path):
                os.unlink(path)


def build_and_load(source: Path, *, abi_symbol: str, abi: int, fast_math: bool = True) -> ctypes.CDLL:
    """The library built from ``source`` (built now unless cached) whose ``abi_symbol()`` returns ``abi``;
    raises :class:`Unavailable` with the reason otherwise.  ``fast_math=False``: built for IEEE arithmetic
    (:data:`EXACT_COMPILE_FLAGS`)."""
    compiler = _compiler()
    if compiler is None:
        raise Unavailable("no C++ compiler found (set $CXX or install g++/clang++)")
    try:
        texts = [source.read_text()]
        texts += [(source.parent / name).read_text() for name in _LOCAL_INCLUDE.findall(texts[0])]
        key = hashlib.sha256(
            "\0".join([*texts, " ".join(_flags(fast_math)), _version(compiler), _cpu_identity()]).encode()
        ).hexdigest()[:16]
        target = cache_dir() / f"{source.stem}-{key}.so"
        if not target.exists():
            _build(compiler, source, target, fast_math)
        if not _trusted(target):
            raise Unavailable(f"{target} is not owned by this user or is writable by others; not loaded")
        lib = ctypes.CDLL(str(target))
        if getattr(lib, abi_symbol)() != abi:
            raise Unavailable(f"{target}: unexpected interface version")
    except Unavailable:
        raise
    except (OSError, AttributeError, subprocess.SubprocessError) as exc:
        raise Unavailable(str(exc)) from exc
    return lib


def void_functions(**signatures: list) -> Callable[[ctypes.CDLL], None]:
    """A ``declare`` for :func:`loader`: each named function of the library takes these ctypes argument
    types and returns nothing."""

    def declare(lib: ctypes.CDLL) -> None:
        for name, argtypes in signatures.items():
            function = getattr(lib, name)
            function.argtypes = argtypes
            function.restype = None

    return declare


def loader(
    source: Path, *, abi_symbol: str, abi: int, declare: Callable[[ctypes.CDLL], None], fast_math: bool = True
) -> tuple[Callable[[], ctypes.CDLL | None], Callable[[], str | None]]:
    """``(load, unavailable_reason)`` for one kernel source: ``load()`` builds the library on first use
    and returns it with ``declare`` applied (its functions' argument types), or None when it cannot be
    had; ``unavailable_reason()`` says why (None when it could).  ``load`` is cached
    (``load.cache_clear()`` forgets it); ``fast_math``: as :func:`build_and_load`'s."""
    reasons: list[str] = []

    @functools.lru_cache(maxsize=None)
    def load() -> ctypes.CDLL | None:
        try:
            lib = build_and_load(source, abi_symbol=abi_symbol, abi=abi, fast_math=fast_math)
            try:
                declare(lib)
            except AttributeError as exc:  # a function the library does not have: no kernel, not a crash
                raise Unavailable(f"{source.name}: {exc}") from exc
        except Unavailable as exc:
            reasons.append(str(exc))
            return None
        return lib

    def unavailable_reason() -> str | None:
        return reasons[-1] if load() is None and reasons else None

    return load, unavailable_reason
