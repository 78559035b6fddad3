"""GMMFormer v2's cross-attention under attention dropout: each value row carries its bias, as in the reference.

The layer pools the tokens first and projects after (W sum_j p_j x_j); the reference projects every token
and pools the values (sum_j p_j (W x_j + b)).  The two agree only while the weights sum to 1, which
dropped weights do not: the bias is then scaled by each head's weight sum.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from prvrlab.models.blocks import Packing
from prvrlab.models.gmmformer_v2 import LearnedQueryAttention


class FixedMask(nn.Module):
    """An attention dropout of rate ``p`` whose keep mask is given (so a hand loop can apply the same draw)."""

    def __init__(self, keep: torch.Tensor, p: float) -> None:
        super().__init__()
        self.keep, self.p = keep, p

    def forward(self, probs: torch.Tensor) -> torch.Tensor:
        return probs * self.keep / (1 - self.p) if self.training else probs


@pytest.mark.parametrize("training", [True, False])
def test_dropped_attention_weights_scale_the_value_bias_per_head(training):
    torch.manual_seed(3)
    lengths, length, branches_n, heads, dh, p = [4, 2, 3], 4, 2, 2, 4, 0.5
    ca = LearnedQueryAttention(hidden_size=heads * dh, num_heads=heads, dropout=0.0, attention_dropout=p)
    nn.init.normal_(ca.value.bias)
    nn.init.normal_(ca.query.bias)
    mask = torch.arange(length)[None] < torch.tensor(lengths)[:, None]
    packing = Packing.from_mask(mask, len(lengths), length, torch.device("cpu"))
    x = torch.randn(branches_n, packing.num_tokens, heads * dh)
    keep = (torch.rand(len(lengths), length, branches_n, heads) > p).float()  # (B, L, K, H)
    keep[0, :, 0, 1] = 0.0  # one head keeps no weight at all: no bias there in the reference
    ca.attn_dropout = FixedMask(keep, p)
    ca.train(training)
    with torch.no_grad():
        got = ca(x, packing)  # (B, K, D)
        rows = packing.rows()
        q = ca.query(ca.phi).view(heads, dh)
        for b, n in enumerate(lengths):
            for k in range(branches_n):
                tokens = x[k][rows == b]  # (n, D)
                keys = (tokens @ ca.key.weight.t()).view(n, heads, dh)
                values = ca.value(tokens).view(n, heads, dh)  # every row with its bias
                att = torch.softmax(torch.einsum("he,nhe->hn", q, keys) / dh**0.5, dim=-1)  # (H, n)
                if training:
                    att = att * keep[b, :n, k].t() / (1 - p)
                ctx = torch.einsum("hn,nhe->he", att, values).reshape(heads * dh)
                s = ca.norm1(ca.phi + ctx)
                want = ca.norm2(s + ca.ffn(s))
                torch.testing.assert_close(got[b, k], want, atol=1e-5, rtol=1e-5)


def test_gradients_under_dropped_weights_equal_the_reference_loop():
    """The bias's and the tokens' gradients through the scaled bias (probs.sum) equal autograd's through the
    reference's per-(video, branch) loop with the same kept weights."""
    torch.manual_seed(4)
    lengths, length, branches_n, heads, dh, p = [3, 1, 4], 4, 2, 2, 4, 0.4
    ca = LearnedQueryAttention(hidden_size=heads * dh, num_heads=heads, dropout=0.0, attention_dropout=p)
    nn.init.normal_(ca.value.bias)
    mask = torch.arange(length)[None] < torch.tensor(lengths)[:, None]
    packing = Packing.from_mask(mask, len(lengths), length, torch.device("cpu"))
    keep = (torch.rand(len(lengths), length, branches_n, heads) > p).float()  # (B, L, K, H)
    ca.attn_dropout = FixedMask(keep, p)
    ca.train()
    x = torch.randn(branches_n, packing.num_tokens, heads * dh, requires_grad=True)
    weights = torch.randn(len(lengths), branches_n, heads * dh)
    (ca(x, packing) * weights).sum().backward()
    got_x, got_bias = x.grad.clone(), ca.value.bias.grad.clone()
    x.grad, ca.value.bias.grad = None, None
    rows, total = packing.rows(), 0.0
    q = ca.query(ca.phi).view(heads, dh)
    for b, n in enumerate(lengths):
        for k in range(branches_n):
            tokens = x[k][rows == b]  # (n, D)
            keys = (tokens @ ca.key.weight.t()).view(n, heads, dh)
            att = torch.softmax(torch.einsum("he,nhe->hn", q, keys) / dh**0.5, dim=-1) * keep[b, :n, k].t() / (1 - p)
            ctx = torch.einsum("hn,nhe->he", att, ca.value(tokens).view(n, heads, dh)).reshape(heads * dh)
            s = ca.norm1(ca.phi + ctx)
            total = total + (ca.norm2(s + ca.ffn(s)) * weights[b, k]).sum()
    total.backward()
    torch.testing.assert_close(got_x, x.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_bias, ca.value.bias.grad, atol=1e-5, rtol=1e-5)
