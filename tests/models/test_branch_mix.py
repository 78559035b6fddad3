"""The fused per-token branch mix (prvrlab/models/branch_mix.py) against sums computed here in float64 from
the same stored values, and against the einsum it replaces."""

from __future__ import annotations

import pytest
import torch

from prvrlab.models import branch_mix

pytestmark = pytest.mark.skipif(branch_mix.load() is None, reason="no C++ compiler to build the kernel")


def inputs(N=301, K=5, D=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    weights = torch.softmax(torch.randn(N, K, generator=g), dim=-1).bfloat16()
    branches = (torch.randn(K, N, D, generator=g) * 2).bfloat16()
    grad = torch.randn(N, D, generator=g).bfloat16()
    return weights, branches, grad


def within_bf16(got: torch.Tensor, want: torch.Tensor) -> bool:
    """float32 sums rounded once to bf16: 2^-8 of each value plus float32 error of the tensor's scale."""
    return bool(((got.double() - want).abs() <= 2**-8 * want.abs() + 1e-6 * want.abs().max()).all())


def test_forward_and_backward_equal_the_float64_sums_of_the_stored_values():
    weights, branches, grad = inputs()
    w, br = weights.clone().requires_grad_(), branches.clone().requires_grad_()
    out = branch_mix.mix(w, br)
    assert out.dtype == torch.bfloat16 and out.grad_fn.name() == "_MixBackward"
    w64, b64, g64 = weights.double(), branches.double(), grad.double()
    want = sum(w64[:, k, None] * b64[k] for k in range(b64.shape[0]))  # (N, D), a hand loop over branches
    assert within_bf16(out, want)
    dw, dbr = torch.autograd.grad(out, (w, br), grad)
    want_dbr = torch.stack([w64[:, k, None] * g64 for k in range(b64.shape[0])])  # (K, N, D)
    want_dw = torch.stack([(g64 * b64[k]).sum(-1) for k in range(b64.shape[0])], dim=1)  # (N, K)
    assert dw.dtype == dbr.dtype == torch.bfloat16
    assert within_bf16(dbr, want_dbr) and within_bf16(dw, want_dw)


def test_equals_the_einsum_to_bf16_rounding_and_float32_keeps_the_einsum():
    weights, branches, grad = inputs(N=64, K=8, D=24, seed=1)
    results = []
    for fn in (branch_mix.mix, lambda w, b: torch.einsum("nk,knd->nd", w, b)):
        w, br = weights.clone().requires_grad_(), branches.clone().requires_grad_()
        out = fn(w, br)
        results.append((out, *torch.autograd.grad(out, (w, br), grad)))
    for a, b in zip(*results):
        a, b = a.detach().float(), b.detach().float()
        assert (a - b).abs().max() <= 2**-7 * b.abs().max()
    w32 = weights.float().requires_grad_()
    assert branch_mix.mix(w32, branches.float()).grad_fn.name() != "_MixBackward"
    with pytest.raises(ValueError, match="weights must be"):
        branch_mix.mix(weights.float(), branches)


def test_only_the_wanted_gradients_are_computed():
    weights, branches, grad = inputs(N=17, K=3, D=8, seed=2)
    br = branches.clone().requires_grad_()
    (dbr,) = torch.autograd.grad(branch_mix.mix(weights, br), (br,), grad)
    want = torch.stack([weights.double()[:, k, None] * grad.double() for k in range(3)])
    assert within_bf16(dbr, want)
    w = weights.clone().requires_grad_()
    (dw,) = torch.autograd.grad(branch_mix.mix(w, branches), (w,), grad)
    assert within_bf16(dw, torch.stack([(grad.double() * branches.double()[k]).sum(-1) for k in range(3)], dim=1))


def test_tokens_over_two_threads():
    weights, branches, grad = inputs(N=1100, K=3, D=16, seed=3)  # over 256-token grains
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        w, br = weights.clone().requires_grad_(), branches.clone().requires_grad_()
        out = branch_mix.mix(w, br)
        dw, dbr = torch.autograd.grad(out, (w, br), grad)
    finally:
        torch.set_num_threads(before)
    w64, b64, g64 = weights.double(), branches.double(), grad.double()
    assert within_bf16(out, sum(w64[:, k, None] * b64[k] for k in range(3)))
    assert within_bf16(dbr, torch.stack([w64[:, k, None] * g64 for k in range(3)]))
    assert within_bf16(dw, torch.stack([(g64 * b64[k]).sum(-1) for k in range(3)], dim=1))
