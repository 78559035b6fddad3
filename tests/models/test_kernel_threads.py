"""Where the C++ kernels run their ranges (prvrlab/models/native.py, native_common.h's run_parallel): on the OpenMP
team PyTorch's own operations run on where that runtime is GNU's and the compiler GCC, else on threads of their own;
the same results either way."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from prvrlab.models import column_sum, layer_norm, native, random_bits

REPO = Path(__file__).resolve().parents[2]
TORCH_RUNTIME = native.openmp_runtime()
shared = pytest.mark.skipif(
    random_bits.load() is None or not native.kernel_openmp(random_bits.load()),
    reason="no kernels, or they do not run on PyTorch's OpenMP team here (another runtime, no -fopenmp build)",
)


def _with_threads(count: int, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


@shared
@pytest.mark.parametrize("threads", [2, 3])
def test_per_thread_sums_are_the_same_bits_on_the_openmp_team_and_on_own_threads(monkeypatch, threads):
    """The column sums and the LayerNorm's affine gradients add per-range float32 partial sums in range order: any
    other split of the rows, or another order of the ranges, changes their last bits on these inputs."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3001, 1536, generator=g) * torch.rand(3001, 1, generator=g) * 40).bfloat16()  # (N, C)
    h = torch.randn(777, 384, generator=g).bfloat16()  # (N, D)
    w, b = torch.randn(384, generator=g), torch.randn(384, generator=g)
    upstream = torch.randn(777, 384, generator=g).bfloat16()  # (N, D)

    builds = {m: m.load.variant for m in (column_sum, layer_norm)}

    def run(openmp: bool) -> list[torch.Tensor]:
        for module, variant in builds.items():
            monkeypatch.setattr(module, "load", lambda lib=variant(openmp=openmp): lib)
        assert native.kernel_openmp(column_sum.load()) == openmp == native.kernel_openmp(layer_norm.load())
        sums = column_sum.column_sum(x)
        xs, ws, bs = (t.detach().clone().requires_grad_() for t in (h, w, b))
        layer_norm.layer_norm(xs, ws, bs).backward(upstream)
        return [sums, xs.grad, ws.grad, bs.grad]

    team, own = _with_threads(threads, lambda: run(True)), _with_threads(threads, lambda: run(False))
    one = _with_threads(1, lambda: run(False))
    for a, c, single in zip(team, own, one):
        assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a.view(torch.int32),
                           c.view(torch.int16) if c.dtype == torch.bfloat16 else c.view(torch.int32))
    assert any(not torch.equal(a, s) for a, s in zip(team[2:], one[2:])), "the inputs do not tell splits apart"


PROBE = """
import torch
torch.randn(512, 512) @ torch.randn(512, 512)
from prvrlab.models import (adam_step, branch_mix, column_sum, fused_scan, layer_norm, native, random_bits, row_chunks,
                            summary_pool, window_best, window_softmax, winners)
kernels = (adam_step, branch_mix, column_sum, fused_scan, layer_norm, random_bits, row_chunks, summary_pool, window_best,
           window_softmax, winners)
libs = [m.load() for m in kernels]
print(sum(lib is not None and native.kernel_openmp(lib) for lib in libs), len(kernels))
print("\\n".join(sorted(native.mapped_openmp_runtimes())))
"""


@shared
def test_every_kernel_binds_to_the_runtime_pytorch_loaded_and_no_other():
    run = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    counts, *runtimes = run.stdout.split("\n")
    on_team, total = map(int, counts.split())
    assert on_team == total == 11
    assert [r for r in runtimes if r] == [TORCH_RUNTIME]


@shared
def test_own_threads_where_no_runtime_can_be_shared(monkeypatch):
    monkeypatch.setattr(native, "openmp_runtime", lambda compiler=None: None)
    kwargs = dict(abi_symbol="prvrlab_column_sum_abi", abi=column_sum.ABI)
    assert not native.kernel_openmp(native.build_and_load(column_sum.SOURCE, **kwargs))
    with pytest.raises(native.Unavailable, match="no OpenMP runtime to share"):
        native.build_and_load(column_sum.SOURCE, openmp=True, **kwargs)
    assert native.kernel_threads() == "threads of their own (no OpenMP runtime to share)"


@shared
def test_the_environment_switch_keeps_own_threads(monkeypatch):
    kwargs = dict(abi_symbol="prvrlab_column_sum_abi", abi=column_sum.ABI)
    assert native.kernel_openmp(native.build_and_load(column_sum.SOURCE, **kwargs))
    assert native.kernel_threads().startswith("PyTorch's OpenMP team")
    monkeypatch.setenv("PRVRLAB_KERNEL_OPENMP", "0")
    assert not native.kernel_openmp(native.build_and_load(column_sum.SOURCE, **kwargs))
    assert "PRVRLAB_KERNEL_OPENMP=0" in native.kernel_threads()


@shared
def test_a_library_that_maps_another_runtime_when_loaded_is_not_used(monkeypatch):
    """A compiler whose -fopenmp links a runtime of its own would put a second team beside PyTorch's."""
    real = native.mapped_openmp_runtimes
    calls = []

    def mapped() -> frozenset[str]:
        calls.append(1)
        return real() | ({"/opt/llvm/lib/libomp.so"} if len(calls) > 1 else set())  # after the library loads

    monkeypatch.setattr(native, "mapped_openmp_runtimes", mapped)
    kwargs = dict(abi_symbol="prvrlab_column_sum_abi", abi=column_sum.ABI)
    with pytest.raises(native.Unavailable, match="libomp.so"):
        native.build_and_load(column_sum.SOURCE, openmp=True, **kwargs)
    calls.clear()
    assert not native.kernel_openmp(native.build_and_load(column_sum.SOURCE, **kwargs))


@pytest.mark.parametrize(
    "mapped, version, expected",
    [
        ({"/t/torch/lib/libgomp.so.1"}, "g++ (Debian 12.2.0-14) 12.2.0", "/t/torch/lib/libgomp.so.1"),
        ({"/usr/lib/x86_64-linux-gnu/libgomp.so.1.0.0"}, "c++ (GCC) 13.1.1", "/usr/lib/x86_64-linux-gnu/libgomp.so.1.0.0"),
        ({"/t/torch.libs/libgomp-a34b3233.so.1"}, "g++ (GCC) 11.2.0", None),  # renamed with its soname: not bound to
        ({"/t/torch/lib/libgomp.so.1"}, "Debian clang version 14.0.6", None),  # clang's -fopenmp: LLVM's runtime
        ({"/t/torch/lib/libiomp5.so"}, "g++ (GCC) 12.2.0", None),  # Intel's runtime
        ({"/t/torch/lib/libomp.so"}, "g++ (GCC) 12.2.0", None),  # LLVM's (macOS-style builds)
        ({"/t/torch/lib/libgomp.so.1", "/usr/lib/libgomp.so.1.0.0"}, "g++ (GCC) 12.2.0", None),  # two already
        (set(), "g++ (GCC) 12.2.0", None),  # no runtime mapped: PyTorch not on OpenMP, or no /proc
    ],
)
def test_which_runtime_is_shared(monkeypatch, mapped, version, expected):
    monkeypatch.setattr(native, "mapped_openmp_runtimes", lambda: frozenset(mapped))
    monkeypatch.setattr(native, "_version", lambda compiler: version)
    monkeypatch.setattr(native, "_torch_on_openmp", lambda: True)
    monkeypatch.setattr(native, "_soname_loaded", lambda soname: soname == "libgomp.so.1")
    assert native.openmp_runtime("/usr/bin/c++") == expected
    monkeypatch.setattr(native, "_soname_loaded", lambda soname: False)  # the loader knows no libgomp.so.1
    assert native.openmp_runtime("/usr/bin/c++") is None
    monkeypatch.setattr(native, "_soname_loaded", lambda soname: soname == "libgomp.so.1")
    monkeypatch.setattr(native, "_PROCESS", -1)  # a forked child of the process that imported native
    assert native.openmp_runtime("/usr/bin/c++") is None
    monkeypatch.setattr(native, "_PROCESS", native.os.getpid())
    monkeypatch.setattr(native, "_torch_on_openmp", lambda: False)  # ATen's pool is another (its native backend)
    assert native.openmp_runtime("/usr/bin/c++") is None


@pytest.mark.parametrize(
    "name, runtime",
    [("libgomp.so.1", True), ("libgomp.so.1.0.0", True), ("libgomp-a34b3233.so.1", True), ("libiomp5.so", True),
     ("libomp.so", True), ("libomp.so.5", True), ("libompitrace.so", False), ("libtorch_cpu.so", False),
     ("libgomp.so.1.py", False)],
)
def test_the_names_of_openmp_runtimes(name, runtime):
    assert bool(native._OPENMP_FILE.match(name)) == runtime


def test_the_build_flags_of_each_threading_enter_the_cache_key():
    assert "-fopenmp" in native._compile_flags(True, openmp=True) and "-fopenmp" in native._link_flags(True)
    assert "-fopenmp" not in native._compile_flags(True) + native._link_flags()
    assert native._flags(True, True) != native._flags(True, False)
    assert native._flags(False, True) != native._flags(False, False)


@shared
def test_a_compiler_that_cannot_build_openmp_code_gives_the_own_threads_build(monkeypatch, tmp_path):
    """No OpenMP headers or library for the compiler (a minimal image): the kernel still builds, on its own
    threads, where it had been unavailable; a library refused for another reason is not rebuilt the other way."""
    real = native._compiler()
    wrapper = tmp_path / "c++"
    wrapper.write_text(
        "#!/bin/sh\nfor a in \"$@\"; do [ \"$a\" = -fopenmp ] && { echo 'omp.h: No such file' >&2; exit 1; }; done\n"
        f"exec {real} \"$@\"\n"
    )
    wrapper.chmod(0o755)
    monkeypatch.setenv("CXX", str(wrapper))
    monkeypatch.setenv("PRVRLAB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "openmp_runtime", lambda compiler=None: TORCH_RUNTIME)
    kwargs = dict(abi_symbol="prvrlab_column_sum_abi", abi=column_sum.ABI)
    with pytest.raises(native.NoSharedOpenMP, match="omp.h: No such file"):
        native.build_and_load(column_sum.SOURCE, openmp=True, **kwargs)
    assert not native.kernel_openmp(native.build_and_load(column_sum.SOURCE, **kwargs))
    (library,) = (tmp_path / "cache" / "native").glob("column_sum-*.so")
    library.chmod(0o777)
    with pytest.raises(native.Unavailable, match="writable by others"):
        native.build_and_load(column_sum.SOURCE, **kwargs)


@shared
def test_a_library_the_loader_refuses_gives_the_own_threads_build(monkeypatch):
    """E.g. a symbol version PyTorch's older libgomp lacks: the OpenMP build fails to load, the other one is used."""
    real = native.ctypes.CDLL
    refused = []

    def cdll(name, *args, **kwargs):
        if str(name).startswith(str(native.cache_dir())) and not refused:
            refused.append(name)
            raise OSError(f"{name}: version `GOMP_9.9' not found")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(native.ctypes, "CDLL", cdll)
    kwargs = dict(abi_symbol="prvrlab_column_sum_abi", abi=column_sum.ABI)
    lib = native.build_and_load(column_sum.SOURCE, **kwargs)
    assert refused and not native.kernel_openmp(lib)


FORKED = """
import os, signal, sys
import torch
from prvrlab.models import column_sum, native
x = torch.randn(4096, 1536).bfloat16()  # (N, C)
expected = x.float().sum(0)
torch.set_num_threads(2)
(torch.randn(2048, 2048) @ torch.randn(2048, 2048)).sum()  # PyTorch's team is made: a child cannot use it
if sys.argv[1] == "loaded":
    column_sum.column_sum(x)  # the kernel runs in the parent before the fork
pid = os.fork()
if pid == 0:
    signal.alarm(20)
    got = column_sum.column_sum(x)
    lib = column_sum.load()
    print(native.kernel_openmp(lib), torch.allclose(got.float(), expected, rtol=1e-2, atol=1e-1), flush=True)
    os._exit(0)
_, status = os.waitpid(pid, 0)
print("exit", os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0)
"""


@shared
@pytest.mark.parametrize("parent", ["loaded", "not loaded"])
def test_a_forked_child_runs_the_kernels_on_threads_of_its_own(parent):
    """GNU OpenMP's team does not survive fork(): a child's first parallel region waits for workers that exist only
    in the parent (PyTorch's own operations hang there).  The kernels take threads of their own in a child, whether
    the parent had loaded them (the library checks its process id) or not (the build chosen in the child)."""
    run = subprocess.run([sys.executable, "-c", FORKED, parent], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    child, parent_line = run.stdout.strip().split("\n")
    assert parent_line == "exit True", run.stdout
    built_for_openmp, right = child.split()
    assert right == "True"
    assert built_for_openmp == ("True" if parent == "loaded" else "False")  # the parent's library, or the child's
