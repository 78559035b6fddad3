"""The packed-token summary pooling kernels (prvrlab/models/summary_pool.py) against float64 hand loops over the same
stored values, and GMMFormer v2's LearnedQueryAttention through them against its PyTorch path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from prvrlab.models import summary_pool
from prvrlab.models.blocks import Packing

pytestmark = pytest.mark.skipif(summary_pool.load() is None, reason="no C++ compiler to build the kernel")


def within_bf16(got: torch.Tensor, want: torch.Tensor) -> bool:
    """float32 sums rounded once to bf16: 2^-8 of each value plus float32 error of the tensor's scale."""
    return bool(((got.double() - want).abs() <= 2**-8 * want.abs() + 1e-6 * want.abs().max()).all())


def test_pool_and_its_gradients_equal_float64_loops_over_each_videos_rows():
    gen = torch.Generator().manual_seed(0)
    K, H, D = 3, 2, 13
    lengths = [4, 0, 7, 1]  # an empty video pools to zeros
    offsets = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int64)
    N = int(offsets[-1])
    p = torch.rand(K, N, H, generator=gen).bfloat16().requires_grad_()
    x = torch.randn(K, N, D, generator=gen).bfloat16().requires_grad_()
    out = summary_pool.pool(p, x, offsets)
    g = torch.randn(out.shape, generator=gen).bfloat16()
    dp, dx = torch.autograd.grad(out, (p, x), g)
    p64, x64, g64 = p.detach().double(), x.detach().double(), g.double()
    want = torch.zeros(K, len(lengths), H, D, dtype=torch.float64)
    want_dp, want_dx = torch.zeros_like(p64), torch.zeros_like(x64)
    for k in range(K):
        for b in range(len(lengths)):
            for n in range(int(offsets[b]), int(offsets[b + 1])):
                for h in range(H):
                    want[k, b, h] += p64[k, n, h] * x64[k, n]
                    want_dp[k, n, h] = (g64[k, b, h] * x64[k, n]).sum()
                    want_dx[k, n] += p64[k, n, h] * g64[k, b, h]
    assert out.dtype == torch.bfloat16 and out[:, 1].abs().max() == 0
    assert within_bf16(out, want) and within_bf16(dp, want_dp) and within_bf16(dx, want_dx)


def test_bad_inputs_are_refused_and_float32_is_not_taken():
    x = torch.randn(2, 5, 4).bfloat16()
    p = torch.rand(2, 5, 3).bfloat16()
    with pytest.raises(ValueError, match="offsets"):
        summary_pool.pool(p, x, torch.tensor([0, 3, 2, 5]))
    with pytest.raises(ValueError, match="offsets"):
        summary_pool.pool(p, x, torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="offsets"):
        summary_pool.pool(p, x, torch.tensor([[0, 5]]))
    with pytest.raises(ValueError, match="offsets"):
        summary_pool.pool(p, x, torch.tensor([0, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="weights and"):
        summary_pool.pool(p.float(), x, torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="weights and"):
        summary_pool.pool(p[..., 0], x, torch.tensor([0, 5]))  # 2-D weights
    with pytest.raises(ValueError, match="weights and"):
        summary_pool.pool(p.to("meta"), x, torch.tensor([0, 5]))  # weights off the CPU (segfaulted; review)
    with pytest.raises(ValueError, match="weights and"):
        summary_pool.pool(p, x[0], torch.tensor([0, 5]))  # 2-D tokens
    assert not summary_pool.takes(x.float()) and summary_pool.takes(x)


def test_segment_offsets_of_packed_full_and_grid_packings():
    packed = Packing.from_lengths(np.array([3, 0, 5]), 6, "cpu")
    assert summary_pool.segment_offsets(packed).tolist() == [0, 3, 3, 8]
    assert summary_pool.segment_offsets(Packing.full(2, 4, "cpu")).tolist() == [0, 4, 8]
    grid = Packing.grid(torch.arange(4)[None, :] < torch.tensor([[2], [4]]))
    assert summary_pool.segment_offsets(grid).tolist() == [0, 4, 8]  # a grid's padded slots are attended to
    shuffled = Packing(2, 3, torch.tensor([2, 1]), torch.tensor([0, 1, 0]), torch.tensor([0, 3, 1]),
                       torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="row order"):
        summary_pool.segment_offsets(shuffled)


@pytest.mark.parametrize("lengths", [[5, 2, 7, 1], [7, 7, 7, 7]], ids=["packed", "full"])
def test_learned_query_attention_through_the_kernels_equals_its_pytorch_path(monkeypatch, lengths):
    """bf16 autocast, training with attention dropout (the same draws): outputs and gradients of the
    kernel path within bf16 rounding of the PyTorch path's."""
    from prvrlab.models.gmmformer_v2 import LearnedQueryAttention

    torch.manual_seed(0)
    layer = LearnedQueryAttention(hidden_size=16, num_heads=4, dropout=0.1, attention_dropout=0.2).train()
    packing = Packing.from_lengths(np.array(lengths), 7, "cpu")
    x = torch.randn(3, packing.num_tokens, 16).bfloat16()
    results = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(summary_pool, "takes", lambda t: False)
        leaf = x.clone().requires_grad_()
        layer.zero_grad()
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = layer(leaf, packing)  # (B, K, D)
        out.float().square().sum().backward()
        results.append((out.detach().float(), leaf.grad.float(), layer.key.weight.grad.clone(),
                        layer.value.weight.grad.clone()))
    for got, want in zip(*results):
        assert (got - want).abs().max() <= 2e-2 * want.abs().max()
