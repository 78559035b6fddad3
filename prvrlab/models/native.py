"""Small C++ kernels (``*.cpp`` beside this module) built on first use and loaded through ctypes.

Build: the system C++ compiler (``$CXX``, else ``c++``/``g++``/``clang++``)
with ``-O3 -march=native -ffast-math`` and linked without ``-ffast-math`` (which would
set flush-to-zero for the whole thread that loads it), no PyTorch headers (a few seconds);
a kernel that must reproduce PyTorch's IEEE arithmetic and NaN rules exactly is built with
``fast_math=False`` (``-ffp-contract=off`` instead, no ``-ffast-math``),
into ``$PRVRLAB_CACHE_DIR/native`` (default ``~/.cache/prvrlab/native``), one
library per source (with the headers beside it that it includes), flags,
compiler and CPU (``-march=native`` code must not run on another CPU kind).
Threads: where PyTorch's CPU operations run on GNU OpenMP (``libgomp.so.1``, the
Linux wheels) and the compiler is GCC, a kernel is built with ``-fopenmp`` and runs
its ranges on that same runtime's thread team (:func:`openmp_runtime`); elsewhere it
starts threads for each call.  The ranges, and so the results, are the same.
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
# A kernel's ranges on the OpenMP team PyTorch's own operations run on (native_common.h's run_parallel): that team's
# workers spin for a while after each operation (libgomp's default wait policy), so threads a kernel started for
# itself shared the cores with them: on 2 cores the kernels took 2-3x their time alone, v2's bf16 step 1.99 ->
# 1.70 s in the same run.  g++ links -fopenmp code against GNU OpenMP's soname, libgomp.so.1, which the loader
# binds to the copy PyTorch already loaded.
OPENMP_COMPILE_FLAGS = ("-fopenmp", "-DPRVRLAB_OPENMP")
OPENMP_LINK_FLAGS = ("-fopenmp",)
# a mapped OpenMP runtime's file name: GNU's, Intel's, LLVM's, and copies renamed by wheel tools (libgomp-1a2b3c.so.1)
_OPENMP_FILE = re.compile(r"^lib(gomp|iomp5|omp)([-.][^/]*)?\.so(\.[0-9]+)*$")
_GNU_OPENMP_FILE = re.compile(r"^libgomp\.so(\.[0-9]+)*$")  # libgomp.so.1, or the file it names: libgomp.so.1.0.0
GNU_OPENMP_SONAME = "libgomp.so.1"  # what g++ -fopenmp code asks the loader for
_PROCESS = os.getpid()  # the process that imported this module (a forked child is another)


# Where the CPU has AVX512-BF16 (Sapphire Rapids and later, Zen 4), whose 512-bit units run at full clock: the
# compiler's 512-bit loops instead of its default 256-bit ones (measured on an AMX Xeon, 2 threads: the fused
# window softmax's forward 24 -> 20 ms, the winners 9.5 -> 5.5 ms, branch LayerNorm forward + backward 28 -> 25
# ms).  Older AVX-512 CPUs keep 256 bits: their 512-bit instructions lower the clock.
WIDE_VECTOR_FLAGS = ("-mprefer-vector-width=512",)


def _compile_flags(fast_math: bool, openmp: bool = False) -> tuple[str, ...]:
    flags = COMPILE_FLAGS if fast_math else EXACT_COMPILE_FLAGS
    flags = (*flags, *WIDE_VECTOR_FLAGS) if _wide_vectors() else flags
    return (*flags, *OPENMP_COMPILE_FLAGS) if openmp else flags


def _link_flags(openmp: bool = False) -> tuple[str, ...]:
    return (*LINK_FLAGS, *OPENMP_LINK_FLAGS) if openmp else LINK_FLAGS


@functools.lru_cache(maxsize=None)
def _wide_vectors() -> bool:
    """Whether this CPU lists ``avx512_bf16`` (Linux /proc/cpuinfo flags)."""
    return re.search(r"\bavx512_bf16\b", _cpu_identity()) is not None


def _flags(fast_math: bool, openmp: bool = False) -> tuple[str, ...]:
    """Both steps' flags, as they enter the cache key."""
    return (*_compile_flags(fast_math, openmp), "-c", "|", *_link_flags(openmp))


def mapped_openmp_runtimes() -> frozenset[str]:
    """Paths of the OpenMP runtime libraries mapped into this process (Linux's /proc/self/maps; empty where it
    cannot be read)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return frozenset()
    fields = (line.split(maxsplit=5) for line in lines)  # address, perms, offset, device, inode[, path]
    paths = (f[5].removesuffix(" (deleted)") for f in fields if len(f) == 6 and f[5].startswith("/"))
    return frozenset(p for p in paths if _OPENMP_FILE.match(os.path.basename(p)))


def _soname_loaded(soname: str) -> bool:
    """Whether a library the loader knows as ``soname`` is in the process (``dlopen`` with ``RTLD_NOLOAD``)."""
    try:
        ctypes.CDLL(soname, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def _torch_on_openmp() -> bool:
    """Whether this process's PyTorch runs its CPU operations on OpenMP (its parallel backend)."""
    import torch

    return "ATen parallel backend: OpenMP" in torch.__config__.parallel_info()


def openmp_runtime(compiler: str | None = None) -> str | None:
    """The OpenMP runtime a kernel built now can share with PyTorch: the path of the one mapped OpenMP runtime
    where it is GNU's, loaded under the soname GCC's ``-fopenmp`` code asks for (:data:`GNU_OPENMP_SONAME`, so the
    loader binds a kernel to this copy), PyTorch runs on OpenMP, ``compiler`` (default: the one kernels are built
    with) is GCC, and this is the process that imported this module; else None, and the kernels start their own
    threads: a second runtime would compete with PyTorch's (a wheel's renamed copy, ``libgomp-1a2b3c.so.1``, has
    a renamed soname too), and GNU OpenMP's team does not survive a fork.  :func:`build_and_load` checks after
    loading that no other runtime came with the library."""
    compiler = compiler or _compiler()
    runtimes = mapped_openmp_runtimes()
    if compiler is None or len(runtimes) != 1 or os.getpid() != _PROCESS:
        return None
    try:
        if "clang" in _version(compiler).lower():
            return None
    except (OSError, subprocess.SubprocessError):
        return None
    (path,) = runtimes
    gnu = _GNU_OPENMP_FILE.match(os.path.basename(path)) and _soname_loaded(GNU_OPENMP_SONAME)
    return path if gnu and _torch_on_openmp() else None



class Unavailable(OSError):
    """A kernel library could not be built or loaded (the message says why)."""


class NoSharedOpenMP(Unavailable):
    """A kernel library cannot run on PyTorch's OpenMP team here (no runtime to share, a build with ``-fopenmp``
    failed, or the library mapped another runtime): it can still be had on threads of its own."""


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


@functools.lru_cache(maxsize=None)
def _version(compiler: str) -> str:
    out = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60)
    return out.stdout.splitlines()[0] if out.stdout else compiler


def _trusted(path: Path) -> bool:
    """Owned by this user and writable by nobody else."""
    st = path.stat()
    return (not hasattr(os, "getuid") or st.st_uid == os.getuid()) and not st.st_mode & 0o022


def _build(compiler: str, source: Path, target: Path, fast_math: bool = True, openmp: bool = False) -> None:
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if not _trusted(target.parent):
        raise Unavailable(f"{target.parent} is not owned by this user or is writable by others")
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    obj = tmp[: -len(".so")] + ".o"
    try:
        for step in ([*_compile_flags(fast_math, openmp), "-c", "-o", obj, str(source)],
                     [*_link_flags(openmp), "-o", tmp, obj]):
            run = subprocess.run([compiler, *step], capture_output=True, text=True, timeout=600)
            if run.returncode != 0:
                raise Unavailable(f"{compiler} failed: {(run.stderr or run.stdout).strip()[-2000:]}")
        os.chmod(tmp, 0o700)
        os.replace(tmp, target)
    finally:
        for path in (tmp, obj):
            if os.path.exists(path):
                os.unlink(path)


def _own_threads_asked() -> bool:
    """Whether ``$PRVRLAB_KERNEL_OPENMP`` is ``0``: kernels on threads of their own wherever they are built."""
    return os.environ.get("PRVRLAB_KERNEL_OPENMP", "1") == "0"


def build_and_load(
    source: Path, *, abi_symbol: str, abi: int, fast_math: bool = True, openmp: bool | None = None
) -> ctypes.CDLL:
    """The library built from ``source`` (built now unless cached) whose ``abi_symbol()`` returns ``abi``;
    raises :class:`Unavailable` with the reason otherwise.  ``fast_math=False``: built for IEEE arithmetic
    (:data:`EXACT_COMPILE_FLAGS`).  ``openmp``: True, its ranges on PyTorch's OpenMP team (:func:`openmp_runtime`)
    or :class:`NoSharedOpenMP` (also where the library maps another runtime when loaded: a compiler that links its
    own); False, on threads of its own; None, the first where it can be had (own threads only where
    ``$PRVRLAB_KERNEL_OPENMP`` is ``0``; any other failure is not retried: an untrusted file stays refused)."""
    if openmp is None:
        if not _own_threads_asked():
            try:
                return build_and_load(source, abi_symbol=abi_symbol, abi=abi, fast_math=fast_math, openmp=True)
            except NoSharedOpenMP:
                pass
        return build_and_load(source, abi_symbol=abi_symbol, abi=abi, fast_math=fast_math, openmp=False)
    compiler = _compiler()
    if compiler is None:
        raise Unavailable("no C++ compiler found (set $CXX or install g++/clang++)")
    try:
        runtime = openmp_runtime(compiler) if openmp else None
        if openmp and runtime is None:
            raise NoSharedOpenMP(f"no OpenMP runtime to share with PyTorch here (mapped: {sorted(mapped_openmp_runtimes())})")
        texts = [source.read_text()]
        texts += [(source.parent / name).read_text() for name in _LOCAL_INCLUDE.findall(texts[0])]
        key = hashlib.sha256(
            "\0".join([*texts, " ".join(_flags(fast_math, openmp)), _version(compiler), _cpu_identity()]).encode()
        ).hexdigest()[:16]
        target = cache_dir() / f"{source.stem}-{key}.so"
        if not target.exists():
            try:
                _build(compiler, source, target, fast_math, openmp)
            except (Unavailable, subprocess.SubprocessError) as exc:
                raise (NoSharedOpenMP(f"built with -fopenmp: {exc}") if openmp else exc) from exc
        if not _trusted(target):
            raise Unavailable(f"{target} is not owned by this user or is writable by others; not loaded")
        try:
            lib = ctypes.CDLL(str(target))
        except OSError as exc:  # e.g. a runtime symbol version the loaded libgomp lacks
            raise (NoSharedOpenMP(f"{target}: {exc}") if openmp else exc) from exc
        if openmp and mapped_openmp_runtimes() != {runtime}:
            raise NoSharedOpenMP(f"{target} loaded another OpenMP runtime: {sorted(mapped_openmp_runtimes() - {runtime})}")
        if getattr(lib, abi_symbol)() != abi:
            raise Unavailable(f"{target}: unexpected interface version")
    except Unavailable:
        raise
    except (OSError, AttributeError, subprocess.SubprocessError) as exc:
        raise Unavailable(str(exc)) from exc
    return lib


def kernel_openmp(lib: ctypes.CDLL) -> bool:
    """Whether a loaded kernel library runs its ranges on PyTorch's OpenMP team (built for it)."""
    function = lib.prvrlab_kernel_openmp
    function.restype = ctypes.c_int
    return function() == 1


def kernel_threads() -> str:
    """Where a kernel built now runs its ranges, in words (for benchmarks' headers)."""
    if _own_threads_asked():
        return "threads of their own ($PRVRLAB_KERNEL_OPENMP=0)"
    runtime = openmp_runtime()
    return f"PyTorch's OpenMP team ({runtime})" if runtime else "threads of their own (no OpenMP runtime to share)"


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
    (``load.cache_clear()`` forgets it); ``load.variant(openmp=...)`` gives either threading build;
    ``fast_math``: as :func:`build_and_load`'s."""
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

    def variant(*, openmp: bool) -> ctypes.CDLL:
        """The library built for ``openmp`` (True: PyTorch's OpenMP team, False: threads of its own), declared;
        raises :class:`Unavailable` (for same-run comparisons of the two)."""
        lib = build_and_load(source, abi_symbol=abi_symbol, abi=abi, fast_math=fast_math, openmp=openmp)
        declare(lib)
        return lib

    load.variant = variant  # type: ignore[attr-defined]
    return load, unavailable_reason
