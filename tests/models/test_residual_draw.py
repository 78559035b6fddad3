"""residual_dropout_draw (prvrlab/models/blocks.py): a residual connection's dropout from a draw, with the
deferred draw's mask never written (prvrlab/models/random_bits.py, residual_masked), against
residual_dropout with the written mask: the same bits forward and backward."""

from __future__ import annotations

import pytest
import torch

from prvrlab.models import random_bits
from prvrlab.models.blocks import dropout_draw, mask_from_draw, residual_dropout, residual_dropout_draw
from prvrlab.models.random_bits import DeferredDraw

pytestmark = pytest.mark.skipif(random_bits.load() is None, reason="no C++ compiler to build the kernel")

K, N, D = 3, 700, 96  # more elements than a thread's grain: two threads' ranges


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The stored bits, every NaN made one value (torch and the kernel may give NaNs different payloads)."""
    return torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t).view(torch.int16)


def _run(fn, x0, a0, probe):
    x, a = x0.clone().requires_grad_(True), a0.clone().requires_grad_(True)
    y = fn(x, a)
    return (y.detach(), *torch.autograd.grad((y.float() * probe).sum(), (x, a))), y.grad_fn


@pytest.mark.parametrize("x_shape", [(N, D), (K, N, D)], ids=["shared-stream", "per-branch"])
def test_the_deferred_residual_equals_the_written_masks_bits_forward_and_backward(x_shape):
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(*x_shape, generator=gen).bfloat16()
    a0 = torch.randn(K, N, D, generator=gen).bfloat16()
    probe = torch.randn(K, N, D, generator=gen)
    p = 0.3
    torch.manual_seed(7)
    draw = dropout_draw((K, N, D), p, torch.device("cpu"), torch.bfloat16, deferred=True)
    assert isinstance(draw, DeferredDraw)
    mask = mask_from_draw(draw, p, torch.bfloat16)
    # signed zeros, infinities and NaN in a where the mask keeps and where it drops, beside zeros of x
    specials = torch.tensor([0.0, -0.0, float("-inf"), float("nan"), float("inf"), -0.0]).bfloat16()
    for kept in (True, False):
        at = ((mask.flatten() != 0) == kept).nonzero().flatten()[: len(specials)]
        a0.view(-1)[at] = specials
        x0.view(-1)[at % x0.numel()] = torch.tensor([-0.0, -0.0, 1.0, 0.0, float("nan"), 0.0]).bfloat16()
    got, fn = _run(lambda x, a: residual_dropout_draw(x, a, draw, p), x0, a0, probe)
    want, _ = _run(lambda x, a: residual_dropout(x, a, mask), x0, a0, probe)
    assert type(fn).__name__ == "_DeferredResidualDropoutBackward"
    for g, w in zip(got, want):
        assert g.shape == w.shape and torch.equal(_bits(g), _bits(w))
    # a slice of the draw (a checkpointed branch) gives the slice of the whole
    part, _ = _run(lambda x, a: residual_dropout_draw(x, a, draw[1:3], p), x0 if x0.dim() == 2 else x0[1:3],
                   a0[1:3], probe[1:3])
    assert torch.equal(_bits(part[0]), _bits(got[0][1:3]))
    with torch.no_grad():
        assert torch.equal(_bits(residual_dropout_draw(x0, a0, draw, p)), _bits(want[0]))


@pytest.mark.parametrize("case", ["float32", "strided x", "written mask", "all dropped"])
def test_what_the_kernel_does_not_take_is_residual_dropout_with_the_mask(case):
    gen = torch.Generator().manual_seed(1)
    dtype = torch.float32 if case == "float32" else torch.bfloat16
    x0 = torch.randn(D, N, generator=gen).to(dtype).t() if case == "strided x" else torch.randn(N, D, generator=gen).to(dtype)
    a0 = torch.randn(K, N, D, generator=gen).to(dtype)
    p = 1.0 - 2**-20 if case == "all dropped" else 0.25  # no int16 draw survives: a mask of zeros
    torch.manual_seed(3)
    draw = dropout_draw((K, N, D), p, torch.device("cpu"), dtype, deferred=case != "written mask")
    probe = torch.randn(K, N, D, generator=gen)
    got, fn = _run(lambda x, a: residual_dropout_draw(x, a, draw, p), x0, a0, probe)
    want, _ = _run(lambda x, a: residual_dropout(x, a, mask_from_draw(draw, p, dtype)), x0, a0, probe)
    assert type(fn).__name__ == "_ResidualDropoutBackward"
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    if case == "all dropped":
        assert torch.equal(got[0], x0.expand(K, N, D))
