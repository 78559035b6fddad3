"""prvrlab.allocator: ``keep`` makes freed large blocks reusable without page faults; ``system`` does not."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from prvrlab import allocator

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 64 << 20  # bytes: well above glibc's largest mmap threshold (32 MiB)

REUSED = 40 << 20  # a smaller block, still above the threshold: fits in the freed first one

PROBE = textwrap.dedent(
    f"""
    import resource, sys
    import torch
    from prvrlab.allocator import host_allocator, set_host_allocator

    def in_heap(address):
        for line in open("/proc/self/maps"):
            if line.rstrip().endswith("[heap]"):
                start, end = (int(x, 16) for x in line.split()[0].split("-"))
                if start <= address < end:
                    return True
        return False

    print(set_host_allocator(sys.argv[1]), host_allocator())
    for size in ({BLOCK}, {REUSED}):  # allocate, touch every page, free
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        block = torch.empty(size // 4, dtype=torch.float32)
        block.fill_(1.0)
        print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, in_heap(block.data_ptr()))
        del block
    """
)


def probe(mode: str) -> tuple[str, list[tuple[int, bool]]]:
    """(what set_host_allocator said, (minor page faults, in malloc's heap) of each block) in a fresh process."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], check=True, capture_output=True, text=True, env=env)
    first, *blocks = out.stdout.splitlines()
    return first, [(int(faults), heap == "True") for faults, heap in (line.split() for line in blocks)]


def huge_pages_always() -> bool:
    """Whether every anonymous mapping gets transparent huge pages (then a fresh block faults far less)."""
    try:
        return "[always]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux") or allocator._mallopt() is None, reason="glibc only")
def test_keep_serves_large_blocks_from_the_heap_and_reuses_their_pages():
    pages = REUSED // os.sysconf("SC_PAGE_SIZE")
    said, system = probe("system")
    assert said == "True system"
    # system: each large block is a fresh mapping of its own, faulted in page by page
    assert [heap for _, heap in system] == [False, False]
    if not huge_pages_always():
        assert system[1][0] >= pages // 2
    said, keep = probe("keep")
    assert said == "True keep"
    # keep: both blocks come from malloc's heap; the second reuses the first one's pages
    assert [heap for _, heap in keep] == [True, True]
    assert keep[0][0] >= system[0][0] // 2
    assert keep[1][0] < pages // 8


def test_an_unknown_setting_names_the_valid_ones():
    with pytest.raises(ValueError, match="host allocator must be one of keep, system, got 'fast'"):
        allocator.set_host_allocator("fast")


def test_without_glibc_keep_is_not_applied(monkeypatch):
    monkeypatch.setitem(allocator._state, "mode", "system")
    monkeypatch.setattr(allocator, "_mallopt", lambda: None)
    assert allocator.set_host_allocator("keep") is False
    assert allocator.host_allocator() == "system"
    assert allocator.set_host_allocator("system") is True


def test_a_refused_setting_leaves_the_mode_unchanged(monkeypatch):
    calls = []

    def refusing(param, value):
        calls.append((param, value))
        return 0

    monkeypatch.setitem(allocator._state, "mode", "system")
    monkeypatch.setattr(allocator, "_mallopt", lambda: refusing)
    assert allocator.set_host_allocator("keep") is False
    assert allocator.host_allocator() == "system"
    assert calls[0] == (-4, 0)  # M_MMAP_MAX first


RELEASE = textwrap.dedent(
    f"""
    import sys
    import torch
    from prvrlab.allocator import release_free_memory, set_host_allocator

    def rss():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10

    set_host_allocator(sys.argv[1])
    block = torch.empty({BLOCK} // 4, dtype=torch.float32)
    block.fill_(1.0)
    pin = torch.ones(1024)  # a live block above it: the freed one is a hole, not the heap's top
    del block
    before = rss()
    released = release_free_memory()
    print(released, before - rss())
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux") or allocator._mallopt() is None, reason="glibc only")
def test_release_gives_a_freed_blocks_pages_back_under_keep_only():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    results = {}
    for mode in ("keep", "system"):
        out = subprocess.run([sys.executable, "-c", RELEASE, mode], check=True, capture_output=True, text=True, env=env)
        released, dropped = out.stdout.split()
        results[mode] = (released == "True", int(dropped))
    assert results["keep"][0] and results["keep"][1] >= BLOCK // 2  # the hole's pages were resident until the release
    assert not results["system"][0] and abs(results["system"][1]) < BLOCK // 8  # system: unmapped at free already


def test_primitive_cache_limit_sets_the_variable_inside_only(monkeypatch):
    """Inside the block oneDNN's and PyTorch's variables hold the caps; afterwards the environment is as
    it was, so processes started later do not inherit them; a value the user set is left alone."""
    from prvrlab.allocator import (
        COMPUTATION_CACHE_VARIABLE, EVAL_COMPUTATION_CACHE, EVAL_PRIMITIVE_CACHE, PRIMITIVE_CACHE_VARIABLE,
        primitive_cache_limit,
    )

    monkeypatch.delenv(PRIMITIVE_CACHE_VARIABLE, raising=False)
    monkeypatch.delenv(COMPUTATION_CACHE_VARIABLE, raising=False)
    with primitive_cache_limit() as applied:
        assert applied == (PRIMITIVE_CACHE_VARIABLE, COMPUTATION_CACHE_VARIABLE)
        assert os.environ[PRIMITIVE_CACHE_VARIABLE] == str(EVAL_PRIMITIVE_CACHE) == "16"
        assert os.environ[COMPUTATION_CACHE_VARIABLE] == str(EVAL_COMPUTATION_CACHE) == "16"
    assert PRIMITIVE_CACHE_VARIABLE not in os.environ and COMPUTATION_CACHE_VARIABLE not in os.environ
    with pytest.raises(RuntimeError), primitive_cache_limit(8, 2):
        raise RuntimeError("an evaluation that fails")
    assert PRIMITIVE_CACHE_VARIABLE not in os.environ and COMPUTATION_CACHE_VARIABLE not in os.environ
    monkeypatch.setenv(PRIMITIVE_CACHE_VARIABLE, "300")
    with primitive_cache_limit() as applied:
        assert applied == (COMPUTATION_CACHE_VARIABLE,) and os.environ[PRIMITIVE_CACHE_VARIABLE] == "300"
    assert os.environ[PRIMITIVE_CACHE_VARIABLE] == "300" and COMPUTATION_CACHE_VARIABLE not in os.environ
    monkeypatch.setenv(COMPUTATION_CACHE_VARIABLE, "5")
    with primitive_cache_limit() as applied:
        assert not applied and os.environ[COMPUTATION_CACHE_VARIABLE] == "5"
    assert os.environ[COMPUTATION_CACHE_VARIABLE] == "5"


SHAPES = textwrap.dedent(
    """
    import sys, torch
    from prvrlab.allocator import malloc_in_use, primitive_cache_limit
    torch.manual_seed(0)
    linear = torch.nn.Linear(768, 384)
    capped = sys.argv[1] == "capped"
    with primitive_cache_limit(4, 4) if capped else primitive_cache_limit(1024, 1024), torch.inference_mode():
        before = malloc_in_use()
        for rows in range(500, 2500, 25):  # 80 shapes, as an evaluation's batches of different lengths
            with torch.autocast("cpu", torch.bfloat16):
                linear(torch.randn(rows, 768))
        print(malloc_in_use() - before)
    """
)


def test_the_eval_caps_bound_what_matrix_products_of_many_shapes_keep():
    """bf16 matrix products of 80 shapes keep a cache entry per shape in PyTorch's and oneDNN's caches
    (1,024 each by default); capped at 4 each by primitive_cache_limit, read at the process's first
    product, the process keeps markedly less of malloc's memory in use afterwards."""
    from prvrlab.allocator import COMPUTATION_CACHE_VARIABLE, PRIMITIVE_CACHE_VARIABLE, malloc_in_use
    from prvrlab.models.precision import native_low_precision

    if not native_low_precision("cpu") or malloc_in_use() is None:
        pytest.skip("bf16 products on oneDNN units and glibc >= 2.33 needed")
    env = {k: v for k, v in os.environ.items() if k not in (PRIMITIVE_CACHE_VARIABLE, COMPUTATION_CACHE_VARIABLE)}
    env["PYTHONPATH"] = str(ROOT)
    kept = {}
    for mode in ("capped", "defaults"):
        out = subprocess.run([sys.executable, "-c", SHAPES, mode], check=True, capture_output=True, text=True, env=env)
        kept[mode] = int(out.stdout.split()[-1])
    assert kept["defaults"] > 8 << 20  # the defaults keep something per shape ...
    assert kept["capped"] < kept["defaults"] / 4  # ... four entries each far less


def test_cap_primitive_caches_sets_what_the_user_left_unset_for_the_rest_of_the_process(monkeypatch):
    from prvrlab.allocator import COMPUTATION_CACHE_VARIABLE, PRIMITIVE_CACHE_VARIABLE, cap_primitive_caches

    monkeypatch.delenv(PRIMITIVE_CACHE_VARIABLE, raising=False)
    monkeypatch.setenv(COMPUTATION_CACHE_VARIABLE, "7")
    assert cap_primitive_caches() == (PRIMITIVE_CACHE_VARIABLE,)
    assert os.environ[PRIMITIVE_CACHE_VARIABLE] == "64" and os.environ[COMPUTATION_CACHE_VARIABLE] == "7"  # not restored
    assert cap_primitive_caches(8, 8) == ()  # both set now: left alone
    assert os.environ[PRIMITIVE_CACHE_VARIABLE] == "64"


def test_malloc_in_use_counts_a_live_block_and_not_a_freed_one():
    """A 64 MiB block malloc hands out shows in ``malloc_in_use`` while it lives and not after ``free``."""
    import ctypes

    before = allocator.malloc_in_use()
    if before is None:
        pytest.skip("no mallinfo2 (not glibc >= 2.33)")
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
    block = libc.malloc(64 << 20)
    held = allocator.malloc_in_use() - before
    libc.free(block)
    after = allocator.malloc_in_use() - before
    assert (64 << 20) <= held < (64 << 20) + (1 << 20) and abs(after) < 1 << 20
