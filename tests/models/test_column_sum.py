"""The bf16 column-sum kernel (prvrlab/models/column_sum.py) against float64 sums of the stored values."""

from __future__ import annotations

import pytest
import torch

from prvrlab.models import column_sum as cs

pytestmark = pytest.mark.skipif(cs.load() is None, reason="no C++ compiler to build the kernel")


def test_wide_bf16_sums_equal_the_float64_column_sums_rounded_once():
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(301, cs.WIDE + 37, generator=gen) * 3).bfloat16()  # (N, C): more rows than a thread's grain
    got = cs.column_sum(x)
    want = x.double().sum(0)
    assert got.dtype == torch.bfloat16 and got.shape == (cs.WIDE + 37,)
    # float32 sums of 301 values, rounded once to bf16
    assert ((got.double() - want).abs() <= 2**-8 * want.abs() + 1e-5 * x.double().abs().sum(0)).all()
    out = torch.full((cs.WIDE + 37,), float("nan"), dtype=torch.bfloat16)
    assert cs.column_sum(x, out=out) is out and torch.equal(out, got)
    torch.testing.assert_close(got.float(), x.sum(0).float(), rtol=2**-7, atol=1e-2)  # ATen's, to rounding


def test_narrow_float32_strided_and_recorded_inputs_are_atens_sum():
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(20, cs.WIDE, generator=gen).bfloat16()
    for x in (wide[:, :64], wide.float(), wide.t().contiguous().t()[:, :cs.WIDE], wide.clone().requires_grad_()):
        got = cs.column_sum(x)
        assert torch.equal(got, x.sum(0)), x.shape
    with pytest.raises(ValueError, match="2-D"):
        cs.column_sum(wide[0])


def test_an_out_of_another_shape_gets_torch_sums_handling():
    x = torch.randn(30, cs.WIDE).bfloat16()
    rows = torch.zeros(3, cs.WIDE, dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match="resized"):
        got = cs.column_sum(x, out=rows)  # resized as torch.sum resizes it, not filled row by row
    assert got.shape == (cs.WIDE,) and torch.equal(got, x.sum(0))


def test_two_threads_add_their_partial_sums():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(500, cs.WIDE, generator=gen).bfloat16()  # several 64-row grains
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = cs.column_sum(x)
    finally:
        torch.set_num_threads(before)
    want = x.double().sum(0)
    assert ((got.double() - want).abs() <= 2**-8 * want.abs() + 1e-5 * x.double().abs().sum(0)).all()


def test_relu_grad_column_sum_is_threshold_backward_then_the_column_sums_in_place():
    """g = h <= 0 ? 0 : g bit for bit as ATen's threshold_backward (a NaN h keeps g; -0, +0, -inf drop it),
    in place, and its float32 column sums rounded once, over rows of both threads."""
    gen = torch.Generator().manual_seed(2)
    N, C = 301, cs.WIDE + 64
    g = (torch.randn(N, C, generator=gen) * 3).bfloat16()
    h = torch.randn(N, C, generator=gen)
    specials = torch.tensor([float("nan"), -float("nan"), 0.0, -0.0, float("inf"), -float("inf"), 1e-40, -1e-40])
    h[:, : specials.numel()] = specials  # every row: each special value once
    h = h.bfloat16()
    want_g = torch.ops.aten.threshold_backward(g, h, 0)
    out = torch.full((C,), float("nan"), dtype=torch.bfloat16)
    original, version = g.clone(), g._version
    got = cs.relu_grad_column_sum(g, h, out)
    assert got.data_ptr() == g.data_ptr() and torch.equal(got, want_g)  # in place, ATen's values
    assert g._version > version  # counted as an in-place write: autograd would refuse a saved copy of g
    assert not torch.equal(got, original)  # some gradients were dropped
    want = want_g.double().sum(0)
    assert ((out.double() - want).abs() <= 2**-8 * want.abs() + 1e-5 * want_g.double().abs().sum(0)).all()


def test_relu_grad_column_sum_leaves_other_inputs_to_aten_without_touching_g():
    gen = torch.Generator().manual_seed(3)
    for shape, dtype in (((20, cs.WIDE), torch.float32), ((20, 64), torch.bfloat16)):
        g = torch.randn(shape, generator=gen).to(dtype)
        h = torch.randn(shape, generator=gen).to(dtype)
        original = g.clone()
        out = torch.empty(shape[1], dtype=dtype)
        got = cs.relu_grad_column_sum(g, h, out)
        want = torch.ops.aten.threshold_backward(original, h, 0)
        assert torch.equal(g, original) and torch.equal(got, want) and torch.equal(out, want.sum(0))
