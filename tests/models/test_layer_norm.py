"""The fused LayerNorm backward (prvrlab/models/layer_norm.py) against LayerNorm's gradients computed here in
float64 from the same stored values, and its forward against ATen's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from prvrlab.models import layer_norm as ln

pytestmark = pytest.mark.skipif(ln.load() is None, reason="no C++ compiler to build the kernel")


def grads(fn, x, w, b, g):
    """(output, dx, dw, db) of ``fn`` at leaf copies of x, w, b (None stays None) for output gradient g."""
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in (x, w, b)]
    y = fn(*leaves)
    wanted = [t for t in leaves if t is not None]
    got = iter(torch.autograd.grad(y, wanted, g))
    return (y.detach(), *(None if t is None else next(got) for t in leaves))


def reference(x, w, b, g, eps=1e-5):
    """(None, dx, dw, db) in float64 by LayerNorm's backward formula from the stored values and the mean and
    1/std that ATen's forward saves (bf16 ones where the affine is bf16 or absent: the backward uses them)."""
    D = x.shape[-1]
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [D], w, b, eps)
    x64, g64 = x.double().reshape(-1, D), g.double().reshape(-1, D)  # (N, D)
    mean, rstd = mean.double().reshape(-1, 1), rstd.double().reshape(-1, 1)  # (N, 1)
    xhat = (x64 - mean) * rstd
    gw = g64 * (1.0 if w is None else w.double())
    dx = rstd * (gw - gw.mean(-1, keepdim=True) - xhat * (gw * xhat).mean(-1, keepdim=True))
    dw = None if w is None else (g64 * xhat).sum(0)
    db = None if b is None else g64.sum(0)
    return None, dx.reshape(x.shape), dw, db


@pytest.mark.parametrize("affine", ["float32", "bf16", "none", "weight-only"])
@pytest.mark.parametrize("shape", [(37, 24), (3, 5, 40), (2, 1, 8)], ids=["2d", "3d", "tiny"])
def test_bf16_backward_equals_the_float64_gradients_and_the_forward_atens(affine, shape):
    gen = torch.Generator().manual_seed(sum(shape))
    D = shape[-1]
    x = (torch.randn(shape, generator=gen) * 3 + 1).bfloat16()
    w = b = None
    if affine != "none":
        dtype = torch.bfloat16 if affine == "bf16" else torch.float32
        w = (torch.rand(D, generator=gen) + 0.5).to(dtype)
        b = None if affine == "weight-only" else torch.randn(D, generator=gen).to(dtype)
    g = torch.randn(shape, generator=gen).bfloat16()
    assert ln._takes(x.requires_grad_(), w, b)
    y, dx, dw, db = grads(ln.layer_norm, x, w, b, g)
    y_aten = F.layer_norm(x.detach(), (D,), w, b)
    assert torch.equal(y, y_aten)  # ATen's forward, the same bits
    _, rx, rw, rb = reference(x.detach(), w, b, g)
    assert dx.dtype == torch.bfloat16
    # float32 arithmetic, one bf16 rounding of dx: 2^-8 of each element plus float32 error of the row's scale
    assert ((dx.double() - rx).abs() <= 2**-8 * rx.abs() + 1e-5 * rx.abs().max()).all()
    for got, want, param in ((dw, rw, w), (db, rb, b)):
        if param is None:
            assert got is None
            continue
        assert got.dtype == param.dtype
        rel = 2**-8 if param.dtype == torch.bfloat16 else 1e-5  # float32 sums, rounded once to the affine's dtype
        assert ((got.double() - want).abs() <= rel * want.abs() + 1e-5 * want.abs().max()).all()


def test_float32_no_grad_and_no_kernel_keep_atens_layer_norm(monkeypatch):
    x = torch.randn(6, 16)
    w, b = torch.rand(16, requires_grad=True), torch.zeros(16, requires_grad=True)
    assert not ln._takes(x, w, b)  # float32: ATen's backward is as fast
    assert ln.layer_norm(x, w, b).grad_fn.name() == "NativeLayerNormBackward0"
    xb = x.bfloat16()
    assert ln.layer_norm(xb, w, b).grad_fn.name() == "_LayerNormBackward"
    with torch.no_grad():
        assert torch.equal(ln.layer_norm(xb, w, b), F.layer_norm(xb, (16,), w, b))
    monkeypatch.setattr(ln, "load", lambda: None)
    assert ln.layer_norm(xb, w, b).grad_fn.name() == "NativeLayerNormBackward0"


def test_the_module_keeps_nn_layernorms_parameters_and_takes_the_fused_backward():
    torch.manual_seed(0)
    plain, fused = nn.LayerNorm(12), ln.LayerNorm(12)
    with torch.no_grad():
        plain.weight.uniform_(0.5, 1.5)
        plain.bias.normal_()
    fused.load_state_dict(plain.state_dict())
    assert list(fused.state_dict()) == ["weight", "bias"] and isinstance(fused, nn.LayerNorm)
    x = torch.randn(9, 12).bfloat16().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_fused, y_plain = fused(x), plain(x)
    assert y_fused.grad_fn.name() == "_LayerNormBackward" and torch.equal(y_fused, y_plain)
    g = torch.randn(9, 12).bfloat16()
    got = torch.autograd.grad(y_fused, (x, fused.weight, fused.bias), g)
    _, rx, rw, rb = reference(x.detach(), plain.weight.detach(), plain.bias.detach(), g)
    for a, r in zip(got, (rx, rw, rb)):
        assert (a.double() - r).abs().max() <= 2**-8 * r.abs().max()


def test_the_affine_gradients_add_every_threads_rows():
    """Rows over several threads (64-row grains): each thread's partial weight and bias sums are added."""
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(517, 48, generator=gen) * 2).bfloat16()
    w, b = torch.rand(48, generator=gen) + 0.5, torch.randn(48, generator=gen)
    g = torch.randn(517, 48, generator=gen).bfloat16()
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _, dx, dw, db = grads(ln.layer_norm, x, w, b, g)
    finally:
        torch.set_num_threads(before)
    _, rx, rw, rb = reference(x, w, b, g)
    assert ((dx.double() - rx).abs() <= 2**-8 * rx.abs() + 1e-5 * rx.abs().max()).all()
    for got, want in ((dw, rw), (db, rb)):
        assert ((got.double() - want).abs() <= 1e-5 * want.abs() + 1e-5 * want.abs().max()).all()


def branch_reference(x, w, b, g, eps=1e-5):
    """(y, dx, dw, db) of a LayerNorm per branch in float64 from the stored values: (K, N, D) x, g; (K, D) w, b."""
    x64, g64, w64, b64 = (t.double() for t in (x, g, w, b))
    mean = x64.mean(-1, keepdim=True)
    rstd = ((x64 - mean).pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    xhat = (x64 - mean) * rstd  # (K, N, D)
    gw = g64 * w64[:, None]
    dx = rstd * (gw - gw.mean(-1, keepdim=True) - xhat * (gw * xhat).mean(-1, keepdim=True))
    return xhat * w64[:, None] + b64[:, None], dx, (g64 * xhat).sum(1), g64.sum(1)


@pytest.mark.parametrize("affine", [torch.float32, torch.bfloat16])
def test_branch_layer_norm_equals_the_float64_layer_norm_of_each_branch(affine):
    """All branches in one kernel call, each with its own affine: forward and gradients against float64
    LayerNorms of the stored values (one bf16 rounding), and within a bf16 rounding of ATen's per-branch
    LayerNorms and their stack (the path it replaces)."""
    gen = torch.Generator().manual_seed(8)
    K, N, D = 3, 150, 40  # more rows than a thread's grain: both threads' rows
    x = (torch.randn(K, N, D, generator=gen) * 3 + torch.arange(K)[:, None, None]).bfloat16()
    w = (torch.rand(K, D, generator=gen) + 0.5).to(affine)
    b = torch.randn(K, D, generator=gen).to(affine)
    g = torch.randn(K, N, D, generator=gen).bfloat16()
    y, dx, dw, db = grads(ln.branch_layer_norm, x, w, b, g)
    ry, rx, rw, rb = branch_reference(x, w, b, g)
    assert y.dtype == dx.dtype == torch.bfloat16 and dw.dtype == db.dtype == affine
    assert ((y.double() - ry).abs() <= 2**-8 * ry.abs() + 1e-5 * ry.abs().max()).all()
    assert ((dx.double() - rx).abs() <= 2**-8 * rx.abs() + 1e-5 * rx.abs().max()).all()
    rel = 2**-8 if affine == torch.bfloat16 else 1e-5
    for got, want in ((dw, rw), (db, rb)):
        assert ((got.double() - want).abs() <= rel * want.abs() + 1e-5 * want.abs().max()).all()
    stacked = lambda x, w, b: torch.stack([ln.layer_norm(x[k], w[k], b[k]) for k in range(K)])  # noqa: E731
    for got, want in zip((y, dx, dw, db), grads(stacked, x, w, b, g)):
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2**-7 * float(want.abs().max()))


def test_branch_layer_norm_leaves_what_it_does_not_take_to_the_caller():
    x = torch.randn(2, 5, 8).bfloat16().requires_grad_()
    w, b = torch.ones(2, 8), torch.zeros(2, 8)
    assert ln.branch_layer_norm(x.detach().float().requires_grad_(), w, b) is None  # float32
    assert ln.branch_layer_norm(x[0], w[0], b[0]) is None  # not (K, N, D)
    assert ln.branch_layer_norm(x, w[:1], b[:1]) is None  # not (K, D) affines
    with torch.no_grad():
        assert ln.branch_layer_norm(x, w, b) is None  # inference keeps ATen's forward
    assert ln.branch_layer_norm(x, w, b).grad_fn.name() == "_BranchLayerNormBackward"
