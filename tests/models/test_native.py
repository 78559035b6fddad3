"""The C++ kernels' build (prvrlab/models/native.py): loading a kernel leaves the process's floating-point
state alone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from prvrlab.models import random_bits

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import torch
tiny = torch.tensor(1e-39, dtype=torch.float64).float()  # a float32 subnormal
assert (tiny * 1.0).item() != 0.0, "subnormals flushed before any kernel was loaded"
from prvrlab.models import (branch_mix, column_sum, fused_scan, layer_norm, random_bits, row_chunks, summary_pool,
                            window_best, window_softmax, winners)
kernels = (branch_mix, column_sum, fused_scan, layer_norm, random_bits, row_chunks, summary_pool, window_best,
           window_softmax, winners)
loaded = [m.__name__ for m in kernels if m.load() is not None]
print(len(loaded), (tiny * 1.0).item())
"""


@pytest.mark.skipif(random_bits.load() is None, reason="no C++ compiler to build the kernels")
def test_loading_the_kernels_does_not_flush_subnormals_to_zero():
    """A library linked with -ffast-math runs crtfastmath's constructor on load, which turns on flush-to-zero
    and denormals-are-zero for the loading thread: 1e-39 * 1.0 then gave 0 in torch itself."""
    run = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    loaded, product = run.stdout.split()
    assert int(loaded) == 10
    assert float(product) == pytest.approx(1e-39, rel=1e-6)


@pytest.mark.skipif(random_bits.load() is None, reason="no C++ compiler to build the kernels")
def test_a_declared_function_the_library_lacks_makes_the_kernel_unavailable_not_a_crash():
    from prvrlab.models import column_sum, native

    load, reason = native.loader(column_sum.SOURCE, abi_symbol="prvrlab_column_sum_abi", abi=column_sum.ABI,
                                 declare=native.void_functions(prvrlab_no_such_function=[]))
    assert load() is None and "prvrlab_no_such_function" in reason()


def test_wide_vectors_only_where_the_cpu_lists_avx512_bf16(monkeypatch):
    """512-bit loops on CPUs with AVX512-BF16; other AVX-512 CPUs (whose 512-bit instructions lower the clock)
    and the rest keep the compiler's default; the choice enters the cache key with the flags."""
    from prvrlab.models import native

    keys = {}
    for name, flags in (("spr", "flags : fpu avx512f avx512_bf16 amx_tile"), ("skx", "flags : fpu avx512f avx512bw"),
                        ("zen1", "flags : fpu avx2 fma")):
        monkeypatch.setattr(native, "_cpu_identity", lambda flags=flags: f"model name : x\n{flags}")
        native._wide_vectors.cache_clear()
        keys[name] = native._flags(True)
        assert ("-mprefer-vector-width=512" in native._compile_flags(True)) == (name == "spr")
        assert ("-mprefer-vector-width=512" in native._compile_flags(False)) == (name == "spr")
    native._wide_vectors.cache_clear()
    assert keys["spr"] != keys["skx"] == keys["zen1"]
