"""The CPU kernels' buffers are CPU tensors whatever torch's default device is.

Under ``PRVRLAB_TEST_DEVICE=cuda`` (the GPU checklist's test stage) tests/conftest.py makes CUDA torch's
default device; a kernel wrapper that made its output with a bare ``torch.empty`` then handed the kernel a
GPU pointer to write from the host (a crash).  The meta device stands in for CUDA here: a buffer that
follows the default device has no storage there, so a wrapper that still does cannot return a CPU result.
"""

from __future__ import annotations

import torch

from prvrlab.models import column_sum, layer_norm, random_bits
from prvrlab.models.blocks import dropout_mask


def test_random_words_and_masks_stay_on_the_cpu():
    with torch.device("meta"):
        words = random_bits.random_words(64)
        seed = random_bits._seed()
    assert words.device.type == "cpu" and isinstance(seed, int)
    x = torch.randn(8, 16)
    with torch.device("meta"):
        mask = dropout_mask(x, 0.3)
    assert mask.device.type == "cpu"
    kept = mask[mask != 0]
    assert mask.shape == x.shape and kept.numel() > 0
    torch.testing.assert_close(kept, torch.full_like(kept, 1 / 0.7))


def test_column_sums_and_layer_norms_stay_on_the_cpu():
    x = torch.randn(64, column_sum.WIDE).to(torch.bfloat16)  # wide enough for the kernel
    assert column_sum._kernel_takes(x, None) == (column_sum.load() is not None)
    want = x.float().sum(0)
    with torch.device("meta"):
        got = column_sum.column_sum(x)
    assert got.device.type == "cpu"
    torch.testing.assert_close(got.float(), want, atol=0.1, rtol=1e-2)
    x = torch.randn(2, 5, 8).to(torch.bfloat16).requires_grad_()  # bf16 with autograd: the fused backward
    w, b = torch.randn(8, requires_grad=True), torch.randn(8, requires_grad=True)
    assert layer_norm._takes(x, w, b) == (layer_norm.load() is not None)
    with torch.device("meta"):
        out = layer_norm.layer_norm(x, w, b)
        out.float().sum().backward()
    assert x.grad.device.type == w.grad.device.type == b.grad.device.type == "cpu"
    x2, w2, b2 = (t.detach().clone().requires_grad_() for t in (x, w, b))
    torch.nn.functional.layer_norm(x2.float(), (8,), w2, b2).sum().backward()
    torch.testing.assert_close(w.grad, w2.grad, atol=0.05, rtol=0.05)
    torch.testing.assert_close(b.grad, b2.grad, atol=0.05, rtol=0.05)
