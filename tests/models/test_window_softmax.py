"""The fused windowed-softmax kernel (prvrlab/models/window_softmax.py) against the formula computed here in
float64: softmax over the real keys of window * logits, zeros on padded query rows, the dropout mask of
the same draw; its backward against autograd of that formula."""

from __future__ import annotations

import pytest
import torch

from prvrlab.models import window_softmax
from prvrlab.models.blocks import dropout_draw, mask_from_draw

pytestmark = pytest.mark.skipif(window_softmax.load() is None, reason="no C++ compiler to build the kernel")

B, K, H, L = 3, 2, 2, 7
# Per element, relative to the float64 value: bf16 outputs are rounded once (2^-8), dropped ones twice
# (weight, then weight x multiplier: 2 x 2^-8); float32 ones carry float32 arithmetic (1e-6).
REL = {torch.float32: 1e-6, torch.bfloat16: 2 * 2**-8}


def assert_close(got: torch.Tensor, want: torch.Tensor, rel: float, absolute: float = 1e-12) -> None:
    """|got - want| <= rel * |want| + absolute, element-wise."""
    error = (got.detach().double() - want.detach()).abs()
    bound = rel * want.detach().abs() + absolute
    worst = float((error - bound).max())
    assert worst <= 0, f"max error {float(error.max()):.3g} exceeds the bound by {worst:.3g}"


def formula(logits, window, keys, rows, draw, p, dtype=torch.float64):
    """The weights in float64 by the definition, (B, K, H, L, L); the dropout multiplier in ``dtype``."""
    x = logits.double() * (window.double() if isinstance(window, torch.Tensor) else window)
    key_ok = torch.ones(B, L, dtype=torch.bool) if keys is None else keys
    x = x.masked_fill(~key_ok[:, None, None, None, :], float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if rows is not None:
        real_rows = torch.arange(L)[None, :] < rows[:, None]  # (B, L)
        probs = probs * real_rows[:, None, None, :, None]
    if draw is not None:
        probs = probs * mask_from_draw(draw, p, dtype).double()
    return probs


def inputs(dtype, seed=0, window_kind="shared"):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, K, H, L, L, generator=g).mul(3).to(dtype)
    lengths = torch.tensor([L, 4, 1])
    keys = torch.arange(L)[None, :] < lengths[:, None]
    if window_kind == "scalar":
        window = 0.37
    else:
        window = torch.rand(1 if window_kind == "shared" else B, K, 1, L, L, generator=g)
    return logits, window, keys, lengths


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window_kind", ["scalar", "shared", "per-batch"])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_forward_and_backward_equal_the_formula(dtype, window_kind, p):
    logits, window, keys, rows = inputs(dtype, window_kind=window_kind)
    torch.manual_seed(5)
    draw = dropout_draw(logits.shape, p, logits.device) if p else None
    leaf = logits.clone().requires_grad_()
    out = window_softmax.WindowSoftmax.apply(leaf, window, keys, rows, draw, p)
    assert out.dtype == dtype and out.shape == logits.shape
    ref_leaf = logits.double().requires_grad_()
    ref = formula(ref_leaf, window, keys, rows, draw, p, dtype)
    assert_close(out, ref.detach(), REL[dtype])
    padded_rows = torch.arange(L)[None, :] >= rows[:, None]
    assert (out.float() * padded_rows[:, None, None, :, None]).abs().max() == 0  # written as zeros
    grad = torch.randn(logits.shape, generator=torch.Generator().manual_seed(9)).to(dtype)
    (got,) = torch.autograd.grad(out, leaf, grad)
    (want,) = torch.autograd.grad(ref, ref_leaf, grad.double())
    assert got.dtype == dtype
    # the row sum sum_j P_ij dP_ij is rounded with the weights: an absolute error of rel x the row's scale
    assert_close(got, want, 2 * REL[dtype], 2 * REL[dtype] * float(want.abs().max()))


def test_grid_without_rows_keeps_every_query_row_and_a_branch_slice_of_the_draw():
    logits, window, keys, _ = inputs(torch.float32, seed=3)
    p = 0.25
    torch.manual_seed(1)
    full_draw = dropout_draw((B, K + 1, H, L, L), p, logits.device)
    draw = full_draw[:, 1:]  # a branch slice: strided over batch and branch, (H, L, L) blocks contiguous
    out = window_softmax.WindowSoftmax.apply(logits, window, keys, None, draw, p)
    ref = formula(logits, window, keys, None, draw, p)
    assert_close(out, ref, REL[torch.float32])
    assert out[2, :, :, 5].abs().sum() > 0  # a padded query row of a grid is computed


def test_row_without_keys_is_uniform_and_a_non_finite_logit_makes_its_row_nan():
    logits, window, keys, _ = inputs(torch.float32, seed=4)
    keys = keys.clone()
    keys[1] = False  # no key at all: uniform, what PyTorch's additive -inf bias gives
    logits[0, 1, 0, 2, 3] = float("nan")
    logits[2, 0, 1, 0, 0] = float("inf")
    out = window_softmax.WindowSoftmax.apply(logits, window, keys, None, None, 0.0)
    assert torch.allclose(out[1], torch.full_like(out[1], 1.0 / L))
    assert out[0, 1, 0, 2].isnan().all() and out[2, 0, 1, 0].isnan().all()
    others = torch.ones_like(out, dtype=torch.bool)
    others[0, 1, 0, 2] = others[2, 0, 1, 0] = False
    assert out[others].isfinite().all()


def test_usable_only_for_contiguous_float_cpu_logits():
    logits = torch.zeros(B, K, H, L, L)
    assert window_softmax.usable(logits) and window_softmax.usable(logits.bfloat16())
    assert not window_softmax.usable(logits.half())
    assert not window_softmax.usable(logits.transpose(-1, -2))
    assert not window_softmax.usable(logits[0])


def test_a_dropout_probability_past_the_int16_threshold_is_refused():
    assert window_softmax.takes(0.0) and window_softmax.takes(0.9) and window_softmax.takes(1 - 2**-16)
    assert not window_softmax.takes(1 - 2**-18)  # the threshold would be 32768: GaussianAttention keeps PyTorch


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
def test_gaussian_attention_training_with_the_kernel_equals_the_plain_path(amp):
    """In its real use (training, attention dropout, padding, a mixed window list, autograd) the fused
    weights give the plain path's outputs and input gradients: fp32 to 1e-5, bf16 autocast to the
    backbone tolerance of tests/models/test_fast_paths.py (2e-2 of the tensor's scale)."""
    from prvrlab.models.blocks import Packing
    from prvrlab.models.gmm import GaussianAttention

    torch.manual_seed(0)
    attn = GaussianAttention(hidden_size=16, num_heads=2, sigmas=[0.5, "inf", 3.0], dropout=0.3).train()
    lengths = torch.tensor([9, 4, 7])
    packing = Packing.from_mask(torch.arange(9)[None, :] < lengths[:, None], 3, 9, "cpu")
    x = torch.randn(packing.num_tokens, 16)
    probe = torch.randn(3, packing.num_tokens, 16)
    results = []
    for fast in (True, False):
        GaussianAttention.fast = fast
        try:
            leaf = x.clone().requires_grad_()
            torch.manual_seed(1)  # the same dropout draw for both
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                out = attn.forward_packed(leaf, packing)  # (K, N, D)
            (grad,) = torch.autograd.grad((out.float() * probe).sum(), leaf)
            results.append((out.float().detach(), grad))
        finally:
            GaussianAttention.fast = True
    tol = 2e-2 if amp else 1e-5
    for got, want in zip(results[0], results[1]):
        scale = max(1.0, float(want.abs().max()))
        assert float((got - want).abs().max()) <= tol * scale


def _refused_inputs():
    """(argument named in the error, logits, window, keys, rows, draw, p) that do not fit the logits."""
    logits, window, keys, rows = inputs(torch.float32, seed=6)
    torch.manual_seed(2)
    draw = dropout_draw(logits.shape, 0.3, logits.device)
    return [
        ("window", logits, window.bfloat16(), keys, rows, None, 0.0),  # read as float32 by the kernel
        ("window", logits, window.double(), keys, rows, None, 0.0),
        ("window", logits, window.expand(1, K, H, L, L), keys, rows, None, 0.0),  # one window per head
        ("window", logits, window[..., :-1, :-1], keys, rows, None, 0.0),
        ("window", logits, torch.rand(2, K, 1, L, L), keys, rows, None, 0.0),  # 2 windows for B = 3
        ("keys", logits, window, keys[:1], rows, None, 0.0),  # one row of keys for B = 3
        ("keys", logits, window, keys[:, :-1], rows, None, 0.0),
        ("keys", logits, window, keys.to(torch.uint8), rows, None, 0.0),  # the plain path's ~keys needs bool
        ("rows", logits, window, keys, rows[:1], None, 0.0),  # rows of another batch entry zeroed
        ("rows", logits, window, keys, rows.float(), None, 0.0),
        ("draw", logits, window, keys, rows, draw[:, :1], 0.3),  # one branch's draw for K = 2
        ("draw", logits, window, keys, rows, draw.to(torch.int32), 0.3),
        ("p", logits, window, keys, rows, draw, -0.1),  # a threshold below int16
        ("p", logits, window, keys, rows, draw, 1 - 2**-18),  # above int16
        ("logits", logits.transpose(-1, -2), window, keys, rows, None, 0.0),
        ("logits", logits.half(), window, keys, rows, None, 0.0),
        ("logits", logits[..., :-1], window, keys, rows, None, 0.0),  # (L, L - 1) matrices
    ]


@pytest.mark.parametrize("case", range(len(_refused_inputs())))
def test_inputs_that_do_not_fit_the_logits_are_refused_before_the_kernel_runs(case):
    name, *args = _refused_inputs()[case]
    with pytest.raises(ValueError, match=f"^{name} must"):
        window_softmax.WindowSoftmax.apply(*args)


def test_a_draw_with_transposed_blocks_gives_the_mask_of_its_values():
    logits, window, keys, rows = inputs(torch.float32, seed=7)
    p = 0.4
    torch.manual_seed(3)
    draw = dropout_draw(logits.shape, p, logits.device).transpose(-1, -2)  # (H, L, L) blocks not contiguous
    leaf = logits.clone().requires_grad_()
    out = window_softmax.WindowSoftmax.apply(leaf, window, keys, rows, draw, p)
    ref_leaf = logits.double().requires_grad_()
    ref = formula(ref_leaf, window, keys, rows, draw, p)
    assert_close(out, ref.detach(), REL[torch.float32])
    grad = torch.randn(logits.shape, generator=torch.Generator().manual_seed(4))
    (got,) = torch.autograd.grad(out, leaf, grad)
    (want,) = torch.autograd.grad(ref, ref_leaf, grad.double())
    assert_close(got, want, 2e-6, 2e-6 * float(want.abs().max()))


@pytest.mark.parametrize("layout", ["one branch", "transposed"])
def test_a_broadcast_or_strided_window_gives_the_formula(layout):
    """A (1, 1, 1, L, L) window multiplies every branch (PyTorch's broadcasting); a window whose (L, L)
    blocks are transposed views gives the values it holds."""
    logits, _, keys, rows = inputs(torch.float32, seed=8)
    g = torch.Generator().manual_seed(8)
    if layout == "one branch":
        window = torch.rand(1, 1, 1, L, L, generator=g)
    else:
        window = torch.rand(B, K, 1, L, L, generator=g).transpose(-1, -2)
    leaf = logits.clone().requires_grad_()
    out = window_softmax.WindowSoftmax.apply(leaf, window, keys, rows, None, 0.0)
    ref_leaf = logits.double().requires_grad_()
    ref = formula(ref_leaf, window, keys, rows, None, 0.0)
    assert_close(out, ref.detach(), REL[torch.float32])
    grad = torch.randn(logits.shape, generator=torch.Generator().manual_seed(5))
    (got,) = torch.autograd.grad(out, leaf, grad)
    (want,) = torch.autograd.grad(ref, ref_leaf, grad.double())
    assert_close(got, want, 2e-6, 2e-6 * float(want.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_infinite_logits_follow_the_plain_paths_finite_key_bias(dtype):
    """-inf and +inf logits give what GaussianAttention's PyTorch path gives, softmax(window * logits + a
    bias of finfo.min / 2 on padded keys): a -inf key weighs 0, a row whose real keys are all -inf spreads
    its weight over the padded keys that are not -inf (NaN when none is left), +inf anywhere makes the row NaN."""
    logits, window, keys, _ = inputs(torch.float32, seed=6)  # keys: batch 0 all real, 1 four, 2 one
    minus, plus = float("-inf"), float("inf")
    logits[0, 0, 0, 0, 2] = minus  # one real key at -inf among finite ones
    logits[0, 1, 1, 3, :] = minus  # every key real and at -inf: NaN
    logits[1, 0, 0, 1, :4] = minus  # all real keys at -inf: uniform over the three padded ones
    logits[1, 0, 1, 2, :4] = minus
    logits[1, 0, 1, 2, 5] = minus  # ... over the two padded ones not at -inf
    logits[1, 1, 0, 0, :] = minus  # every key at -inf: NaN
    logits[1, 1, 1, 4, 6] = minus  # a padded key at -inf: an ordinary row
    logits[2, 0, 0, 5, 3] = plus  # +inf on a padded key: NaN
    logits[2, 1, 1, 6, 0] = plus  # +inf on the real key: NaN
    logits = logits.to(dtype)
    bias = torch.zeros(B, L).masked_fill(~keys, torch.finfo(torch.float32).min / 2)
    want = torch.softmax(logits.float() * window + bias[:, None, None, None, :], dim=-1)
    got = window_softmax.WindowSoftmax.apply(logits, window, keys, None, None, 0.0).float()
    torch.testing.assert_close(got, want, rtol=REL[dtype], atol=1e-7, equal_nan=True)
    assert got[0, 0, 0, 0, 2] == 0 and got[0, 0, 0, 0].sum().item() == pytest.approx(1, rel=1e-2)
    assert torch.equal(got[1, 0, 0, 1], torch.tensor([0, 0, 0, 0, 1 / 3, 1 / 3, 1 / 3]).to(dtype).float())
    assert torch.equal(got[1, 0, 1, 2], torch.tensor([0, 0, 0, 0, 0.5, 0, 0.5]))
    nan_rows = [(0, 1, 1, 3), (1, 1, 0, 0), (2, 0, 0, 5), (2, 1, 1, 6)]
    for index in nan_rows:
        assert got[index].isnan().all(), index
    assert got.isnan().sum() == len(nan_rows) * L
    grad = torch.randn(logits.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    leaf = logits.clone().requires_grad_()
    (dlogits,) = torch.autograd.grad(window_softmax.WindowSoftmax.apply(leaf, window, keys, None, None, 0.0), leaf,
                                     grad)
    assert dlogits[0, 0, 0, 0, 2] == 0 and dlogits[1, 0, 0, 1, :4].abs().max() == 0  # no gradient into -inf keys


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_dropped_non_finite_values_stay_nan_as_the_mask_multiply_gives(dtype):
    """With dropout, a NaN weight or an inf / NaN incoming gradient on a dropped element is NaN times 0 in
    PyTorch, not 0: the row of a NaN logit is NaN in every element, dropped or kept, and a NaN gradient on a
    dropped element makes its row's gradient NaN (the build assumes finite math; found by review)."""
    p = 0.5
    logits = torch.zeros(2, 1, 1, 4, 4)
    logits[0, 0, 0, 0, 1] = float("nan")
    draw = torch.full(logits.shape, -32768, dtype=torch.int16)  # every element dropped ...
    draw[..., 0, 0] = 32767  # ... but key 0 of each row 0
    leaf = logits.to(dtype).requires_grad_()
    got = window_softmax.WindowSoftmax.apply(leaf, 1.0, None, None, draw, p)
    ref_leaf = logits.to(dtype).float().requires_grad_()
    want = torch.softmax(ref_leaf, -1) * mask_from_draw(draw, p, torch.float32)
    torch.testing.assert_close(got.float(), want, equal_nan=True, rtol=REL[dtype], atol=0)
    assert got[0, 0, 0, 0].isnan().all() and got[1].isfinite().all()
    g = torch.ones(logits.shape)
    g[1, 0, 0, 1, 2] = float("nan")  # dropped
    g[1, 0, 0, 2, 3] = float("inf")  # dropped
    (d_got,) = torch.autograd.grad(got, leaf, g.to(dtype))
    (d_want,) = torch.autograd.grad(want, ref_leaf, g)
    torch.testing.assert_close(d_got.float(), d_want, equal_nan=True, rtol=REL[dtype], atol=1e-6)
    assert d_got[1, 0, 0, 1].isnan().all() and d_got[1, 0, 0, 2].isnan().all()
    assert d_got[1, 0, 0, 3].isfinite().all()
