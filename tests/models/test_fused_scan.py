"""The fused CPU selective scan (prvrlab/models/selective_scan.cpp through fused_scan.py): forward and
gradients against the float64 step-by-step recurrence, masks, threads, the dispatch, and every way
the build can fail (no compiler, a compiler error, a library others could have written)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from prvrlab.models import fused_scan
from prvrlab.models.mamba import Mamba, _fused_or_none, selective_scan, selective_scan_chunked, selective_scan_reference
from tests.models.test_mamba import scan_inputs

pytestmark = pytest.mark.skipif(fused_scan.load() is None, reason=f"fused scan unavailable: {fused_scan.unavailable_reason()}")


@pytest.fixture(autouse=True)
def _on_the_cpu():
    """The fused scan is the CPU kernel: its tests run on the CPU whatever PRVRLAB_TEST_DEVICE names."""
    with torch.device("cpu"):
        yield


def fused(x, delta, A, B, C, D=None, *, chunk=32, mask=None):
    return selective_scan(x, delta, A, B, C, D, mask=mask, chunk=chunk, kernel="fused")


@pytest.mark.parametrize(
    "batch, length, channels, state, chunk",
    [(1, 1, 1, 1, 1), (2, 11, 3, 4, 4), (3, 40, 20, 5, 16), (2, 37, 33, 16, 32), (1, 9, 16, 7, 64), (4, 20, 48, 16, 3)],
)
def test_forward_and_gradients_match_the_float64_recurrence(batch, length, channels, state, chunk):
    """Channels not a multiple of the 16-channel block, chunks longer / shorter than the sequence, any N."""
    ref_args = [t.requires_grad_() for t in scan_inputs(batch, length, channels, state, seed=batch + length)]
    args = [t.detach().float().requires_grad_() for t in ref_args]
    weights = torch.randn(batch, length, channels, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    expected = selective_scan_reference(*ref_args)
    want = torch.autograd.grad((expected * weights).sum(), ref_args)
    got = fused(*args, chunk=chunk)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad((got * weights.float()).sum(), args)
    for name, g, w in zip(("x", "delta", "A", "B", "C", "D"), grads, want):
        scale = float(w.abs().max()) + 1e-6
        assert float((g.double() - w).abs().max()) / scale < 2e-5, name


def test_large_decays_and_steps_stay_exact():
    """Steps with delta * A far below -87 (decays of ~0): the fast exp clamps there without harm."""
    ref_args = scan_inputs(batch=2, length=30, channels=17, state=16, seed=3, big_steps=True)
    got = fused(*(t.float() for t in ref_args), chunk=8)
    torch.testing.assert_close(got.double(), selective_scan_reference(*ref_args), rtol=1e-5, atol=1e-5)


def test_masked_steps_pass_the_state_through_as_the_recurrence_does():
    args = [t.float() for t in scan_inputs(batch=3, length=12, channels=18, state=4, seed=7)]
    mask = torch.ones(3, 12, dtype=torch.bool)
    mask[0, 9:] = False
    mask[2, 4:] = False
    torch.testing.assert_close(fused(*args, mask=mask, chunk=5), selective_scan_reference(*args, mask=mask),
                               rtol=1e-5, atol=1e-5)


def test_results_do_not_depend_on_the_thread_count():
    """Each thread owns whole sequences: outputs are bitwise equal; dA sums per-thread partials."""
    args = [t.float().requires_grad_() for t in scan_inputs(batch=5, length=21, channels=40, state=8, seed=2)]
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            y = fused(*args, chunk=8)
            results.append((y, torch.autograd.grad(y.square().sum(), args)))
    finally:
        torch.set_num_threads(threads)
    (y1, g1), (y3, g3) = results
    assert torch.equal(y1, y3)
    for a, b in zip(g1, g3):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_auto_picks_the_fused_kernel_on_cpu_and_matches_the_chunked_scan():
    args = [t.float() for t in scan_inputs(batch=2, length=19, channels=24, state=16, seed=4)]
    torch.testing.assert_close(selective_scan(*args), selective_scan_chunked(*args, chunk=8), rtol=1e-5, atol=1e-5)
    empty = selective_scan(*(t[:, :0] if t.dim() == 3 else t for t in args))
    assert empty.shape == (2, 0, 24)


def test_mamba_block_trains_the_same_with_either_kernel():
    torch.manual_seed(0)
    fast = Mamba(hidden_size=12, d_state=6, scan_chunk=4, scan_kernel="fused")
    slow = Mamba(hidden_size=12, d_state=6, scan_chunk=4, scan_kernel="torch")
    slow.load_state_dict(fast.state_dict())
    x = torch.randn(3, 10, 12)
    out_fast, out_slow = fast(x), slow(x)
    torch.testing.assert_close(out_fast, out_slow, rtol=1e-5, atol=1e-6)
    out_fast.square().sum().backward()
    out_slow.square().sum().backward()
    for (name, a), b in zip(fast.named_parameters(), slow.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.fixture
def fresh_build(tmp_path, monkeypatch):
    """A private cache folder and a cleared ``load`` cache (restored afterwards)."""
    monkeypatch.setenv("PRVRLAB_CACHE_DIR", str(tmp_path / "cache"))
    fused_scan.load.cache_clear()
    yield tmp_path / "cache" / "native"
    fused_scan.load.cache_clear()


def test_no_compiler_falls_back_with_one_warning(fresh_build, monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert fused_scan.load() is None
    assert "no C++ compiler" in fused_scan.unavailable_reason()
    args = [t.float() for t in scan_inputs(batch=1, length=5, channels=3, state=2)]
    with pytest.warns(RuntimeWarning, match="no C.. compiler.*chunked scan"):
        y = selective_scan(*args)
    torch.testing.assert_close(y, selective_scan_chunked(*args))
    with pytest.raises(RuntimeError, match="'fused' could not be built: no C.. compiler"):
        selective_scan(*args, kernel="fused")


def test_a_failing_compiler_is_reported_and_leaves_no_library(fresh_build, monkeypatch, tmp_path):
    broken = tmp_path / "broken-c++"
    broken.write_text("#!/bin/sh\necho 'fatal: this compiler is broken' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CXX", str(broken))
    assert fused_scan.load() is None
    assert "this compiler is broken" in fused_scan.unavailable_reason()
    assert not list(fresh_build.glob("*.so"))


def test_a_library_others_can_write_is_not_loaded(fresh_build):
    assert fused_scan.load() is not None  # builds into the private folder
    (library,) = fresh_build.glob("selective_scan-*.so")
    assert oct(library.stat().st_mode & 0o777) == oct(0o700)
    os.chmod(library, 0o777)
    fused_scan.load.cache_clear()
    assert fused_scan.load() is None
    assert "writable by others" in fused_scan.unavailable_reason()


def test_fused_kernel_refuses_non_cpu_requests():
    """Asked for on another device (here: meta), 'fused' is an error; 'auto' leaves it to the others."""
    x = torch.zeros(1, 3, 2, device="meta")
    with pytest.raises(ValueError, match="CPU tensors only"):
        _fused_or_none(x, "fused")
    assert _fused_or_none(x, "auto") is None
    cpu = torch.zeros(1, 3, 2)
    assert _fused_or_none(cpu, "torch") is None
    assert _fused_or_none(cpu, "auto") is fused_scan.FusedScan


def test_broadcast_inputs_give_the_recurrence_of_their_expanded_shapes():
    """delta (B, L, 1) (one step per token), A (1, N), B and C (1, L, N) broadcast as in the recurrence's
    products; their gradients are the expanded ones summed back."""
    batch, length, channels, state = 3, 13, 20, 4
    full = scan_inputs(batch, length, channels, state, seed=5)
    ref_args = [full[0], full[1][..., :1], full[2][:1], full[3][:1], full[4][:1]]
    ref_args = [t.clone().requires_grad_() for t in ref_args]
    args = [t.detach().float().requires_grad_() for t in ref_args]
    weights = torch.randn(batch, length, channels, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    expected = selective_scan_reference(*ref_args)
    want = torch.autograd.grad((expected * weights).sum(), ref_args)
    got = fused(*args, chunk=4)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad((got * weights.float()).sum(), args)
    for name, g, w in zip(("x", "delta", "A", "B", "C"), grads, want):
        assert g.shape == w.shape, name
        scale = float(w.abs().max()) + 1e-6
        assert float((g.double() - w).abs().max()) / scale < 2e-5, name


@pytest.mark.parametrize(
    "name, index, shape",
    [("delta", 1, (2, 6, 3)), ("delta", 1, (2, 5, 20)), ("A", 2, (8, 4)), ("A", 2, (4,)), ("B", 3, (2, 6, 5)),
     ("C", 4, (2, 1, 6, 4)), ("x", 0, (6, 20))],
)
def test_shapes_that_do_not_broadcast_are_refused(name, index, shape):
    args = [t.float() for t in scan_inputs(batch=2, length=6, channels=20, state=4, seed=1)][:5]
    args[index] = torch.rand(shape)
    with pytest.raises(ValueError, match=f"^{name} must be"):
        fused(*args)


def test_a_chunk_longer_than_the_sequence_is_clamped_and_a_bad_one_refused():
    """The backward's scratch is chunk x N x 16 floats: a huge chunk is the sequence length, as in the
    chunked scan."""
    args = [t.float().requires_grad_() for t in scan_inputs(batch=2, length=6, channels=20, state=16, seed=3)][:5]
    results = []
    for chunk in (6, 2**40, 2**59):
        y = fused(*args, chunk=chunk)
        results.append((y, torch.autograd.grad(y.square().sum(), args)))
    for y, grads in results[1:]:
        assert torch.equal(y, results[0][0])
        for g, w in zip(grads, results[0][1]):
            assert torch.equal(g, w)
    for chunk in (0, -3, 2.5):
        with pytest.raises(ValueError, match="chunk must be a positive integer"):
            fused(*args, chunk=chunk)
