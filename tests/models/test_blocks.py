"""Tests of the shared blocks against hand computations and naive loops."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from prvrlab.data.batch import prefix_mask, tag_lengths
from prvrlab.models.blocks import (
    AttentionPooling,
    InputProjection,
    Packing,
    PositionalEmbedding,
    SequenceEncoder,
    branch_layer_norm,
    dropout_mask,
    project,
    residual_dropout,
)
from prvrlab.models.gmm import (
    GaussianAttention,
    GMMBlock,
    TransformerLayer,
    batched_windows,
    gaussian_window,
    parse_sigmas,
)
from device_under_test import DEVICE


def hand_window(n: int, sigma: float) -> list[list[float]]:
    width = sigma / 9
    pos = [i / (n - 1) if n > 1 else 0.0 for i in range(n)]
    return [[math.exp(-((pj - pi) ** 2) / (2 * width**2)) for pj in pos] for pi in pos]


@pytest.mark.parametrize("n, sigma", [(5, 1.0), (7, 0.5), (4, 5.0), (1, 1.0)])
def test_gaussian_window_matches_hand_computation(n, sigma):
    got = gaussian_window(n, sigma, window="centred", device=DEVICE)
    assert got.shape == (n, n)
    torch.testing.assert_close(got, torch.tensor(hand_window(n, sigma)), atol=1e-6, rtol=1e-5)
    assert torch.all(torch.diagonal(got) == 1)


def test_gaussian_window_values_spot_check():
    # n = 3, sigma = 1: offsets 0, 0.5, 1 with width 1/9 -> exp(-0.25 * 81 / 2), exp(-81 / 2)
    w = gaussian_window(3, 1.0, window="centred", device=DEVICE)
    assert math.isclose(w[0, 1].item(), math.exp(-10.125), rel_tol=1e-5)
    assert math.isclose(w[0, 2].item(), math.exp(-40.5), rel_tol=1e-4)


def test_gaussian_window_infinite_is_all_ones_and_cached():
    assert torch.equal(gaussian_window(6, math.inf, device=DEVICE), torch.ones(6, 6))
    assert gaussian_window(6, 2.0, device=DEVICE) is gaussian_window(6, 2.0, device=DEVICE)


def test_batched_windows_use_each_sequence_real_length():
    windows = batched_windows(torch.tensor([5, 3, 6]), 6, (1.0, math.inf), "centred")  # (B, K, L, L)
    assert windows.shape == (3, 2, 6, 6)
    torch.testing.assert_close(windows[0, 0, :5, :5], gaussian_window(5, 1.0, window="centred", device=DEVICE))
    torch.testing.assert_close(windows[1, 0, :3, :3], gaussian_window(3, 1.0, window="centred", device=DEVICE))
    torch.testing.assert_close(windows[2, 0], gaussian_window(6, 1.0, window="centred", device=DEVICE))
    assert torch.equal(windows[:, 1], torch.ones(3, 6, 6))


def test_parse_sigmas():
    assert parse_sigmas([0.5, 1, "inf", float("inf")]) == (0.5, 1.0, math.inf, math.inf)
    for bad in ([0.0], [-1.0], ["x"], [], "inf", [True]):
        with pytest.raises(ValueError, match="sigmas"):
            parse_sigmas(bad)


def naive_gaussian_attention(attn: GaussianAttention, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Branch by branch, head by head, video by video, on the unpadded sequences: (K, B, L, D)."""
    D, K, H = attn.hidden_size, attn.num_branches, attn.num_heads
    dh = D // H
    wq, wk, wv = attn.qkv.weight.split(K * D)  # layout [Q | K | V], each (K, H, dh)
    bq, bk, bv = attn.qkv.bias.split(K * D)
    out = torch.zeros(K, *x.shape)
    for b, n in enumerate(lengths):
        if n == 0:
            continue
        xb = x[b, :n]  # (n, D)
        for k, sigma in enumerate(attn.sigmas):
            window = torch.tensor(hand_window(n, sigma)) if math.isfinite(sigma) else torch.ones(n, n)
            heads = []
            for h in range(H):
                rows = slice(k * D + h * dh, k * D + (h + 1) * dh)
                q = xb @ wq[rows].T + bq[rows]
                kk = xb @ wk[rows].T + bk[rows]
                v = xb @ wv[rows].T + bv[rows]
                logits = window * (q @ kk.T) / math.sqrt(dh)
                heads.append(torch.softmax(logits, dim=-1) @ v)
            a_k = torch.cat(heads, dim=-1)  # (n, D)
            out[k, b, :n] = a_k @ attn.out.weight[k].T + attn.out.bias[k]
    return out


def naive_gmm_block(block: GMMBlock, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """mean_k LayerNorm_k(x + branch_k), video by video (eval mode, no FFN)."""
    branches = naive_gaussian_attention(block.attention, x, lengths)
    out = torch.zeros_like(x)
    for b, n in enumerate(lengths):
        for t in range(n):
            normed = []
            for k in range(block.attention.num_branches):
                h = x[b, t] + branches[k, b, t]
                h = (h - h.mean()) / torch.sqrt(h.var(unbiased=False) + 1e-5)
                normed.append(h * block.norm_weight[k] + block.norm_bias[k])
            out[b, t] = torch.stack(normed).mean(0)
    return out


def randomise(module: torch.nn.Module) -> None:
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.5)


@pytest.mark.parametrize("sigmas", [(0.5, math.inf, 2.0), (math.inf,), (1.0,)])
def test_fused_branches_equal_naive_loop(sigmas):
    attn = GaussianAttention(hidden_size=8, num_heads=2, sigmas=sigmas, window="centred", window_length="real").eval()
    randomise(attn)
    lengths = [5, 3, 0, 1]
    x = torch.randn(4, 5, 8)
    mask = torch.arange(5)[None] < torch.tensor(lengths)[:, None]
    torch.testing.assert_close(attn(x, mask), naive_gaussian_attention(attn, x, lengths), atol=1e-5, rtol=1e-4)
    full = attn(x[:1])  # no mask: the cached-window path
    torch.testing.assert_close(full, naive_gaussian_attention(attn, x[:1], [5]), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("lengths", [[5, 3, 0, 1], [5, 5]])
def test_gmm_block_and_gradients_equal_naive_loop(lengths):
    block = GMMBlock(hidden_size=8, num_heads=2, sigmas=(0.5, math.inf, 2.0), window="centred", window_length="real")
    block.eval()
    randomise(block)
    x = torch.randn(len(lengths), 5, 8, requires_grad=True)
    mask = torch.arange(5)[None] < torch.tensor(lengths)[:, None]
    weights = torch.randn(len(lengths), 5, 8) * mask[..., None]
    results = []
    for fn in (lambda: block(x, mask), lambda: naive_gmm_block(block, x, lengths)):
        block.zero_grad()
        x.grad = None
        y = fn()
        (y * weights).sum().backward()
        results.append((y.detach(), x.grad.clone(), block.attention.qkv.weight.grad.clone(),
                        block.attention.out.weight.grad.clone(), block.norm_weight.grad.clone()))
    for fused, naive in zip(*results):
        torch.testing.assert_close(fused, naive, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("amp", [None, torch.bfloat16])
def test_gmm_block_inference_sums_branches_one_at_a_time_with_the_same_bits(amp):
    """At inference GMMBlock adds the residual and normalises one branch at a time (no (K, N, D) sum):
    the same bits as the autograd path, in float32 and under bf16 autocast (bf16 branches + float32
    residual); the naive loop to 1e-4 in float32.  Without autograd but in training mode with dropout,
    dropout still applies (the grad-free path is not taken)."""
    block = GMMBlock(hidden_size=8, num_heads=2, sigmas=(0.5, math.inf, 2.0), window="centred", window_length="real")
    block.eval()
    randomise(block)
    lengths = [5, 3, 1]
    x = torch.randn(3, 5, 8)
    mask = torch.arange(5)[None] < torch.tensor(lengths)[:, None]
    with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
        with_grad = block(x.clone().requires_grad_(True), mask).detach()
        with torch.no_grad():
            without = block(x, mask)
    assert with_grad.dtype == without.dtype and torch.equal(without, with_grad)
    if amp is None:
        real = mask[..., None].expand_as(x)
        torch.testing.assert_close(without[real], naive_gmm_block(block, x, lengths)[real], atol=1e-4, rtol=1e-4)
    block.dropout.p = 0.5
    block.train()
    with torch.no_grad():
        torch.manual_seed(0)
        dropped = block(x, mask)
    assert not torch.equal(dropped, without)


def test_gmm_block_fully_padded_row_is_finite_and_zero():
    block = GMMBlock(hidden_size=8, num_heads=2, sigmas=(1.0, math.inf), dropout=0.1).train()
    x = torch.randn(3, 4, 8, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    y = block(x, mask)
    assert torch.isfinite(y).all()
    assert torch.equal(y[1], torch.zeros(4, 8))
    y.sum().backward()
    assert torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in block.parameters())


def test_gmm_block_ignores_padding():
    block = GMMBlock(
        hidden_size=8, num_heads=2, sigmas=(0.5, 1.0, math.inf), dropout=0.0, window="centred", window_length="real"
    ).eval()
    x = torch.randn(2, 6, 8)
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2], dtype=torch.bool)
    y = block(x, mask)
    torch.testing.assert_close(y[1, :4], block(x[1:, :4])[0], atol=1e-5, rtol=1e-5)
    x2 = x.clone()
    x2[1, 4:] = 100.0  # garbage in padding changes nothing
    torch.testing.assert_close(block(x2, mask), y)


def test_transformer_layer_is_plain_attention_with_ffn():
    layer = TransformerLayer(hidden_size=8, num_heads=2, dropout=0.0)
    assert layer.sigmas == (math.inf,)
    assert layer.attention.plain
    assert layer.ffn is not None and layer.ffn[0].out_features == 4 * 8  # None: 4 * hidden_size
    assert TransformerLayer(hidden_size=8, num_heads=2, ffn_size=12).ffn[0].out_features == 12
    assert TransformerLayer(hidden_size=8, num_heads=2, ffn_size=0).ffn is None
    assert GMMBlock(hidden_size=8, num_heads=2).ffn is None  # GMMBlock: none by default, as the reference
    assert GMMBlock(hidden_size=8, num_heads=2, ffn_size=None).ffn[2].in_features == 4 * 8
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="ffn_size"):
            GMMBlock(hidden_size=8, ffn_size=bad)


def test_encode_padded_runs_over_the_padding_with_the_real_tokens_as_keys():
    """SequenceEncoder.encode_padded: every slot's output, a padded one's from its own input and the row's
    real tokens only, as a reference encoder run over zero-padded rows with a key mask computes it (hand
    loop: one head at a time, query slots 0..L-1, key slots 0..n-1); the real slots equal encode's."""
    torch.manual_seed(0)
    layer = lambda: TransformerLayer(hidden_size=8, num_heads=2, dropout=0.0, ffn_size=0)  # noqa: E731
    enc = SequenceEncoder(in_dim=6, hidden_size=8, max_len=6, dropout=0.0, layer=layer)
    randomise(enc)
    enc.eval()
    lengths, L = [5, 2, 3], 5
    mask = prefix_mask(np.array(lengths), L)
    x = torch.randn(3, L, 6) * mask[..., None]  # zero features on padding, as a collate pads them
    got = enc.encode_padded(x, mask)  # (B, L, D)
    attn, block = enc.layers[0].attention, enc.layers[0]
    h = enc.pos(enc.proj(x))  # (B, L, D) token-wise, positions 0..L-1
    wq, wk, wv = attn.qkv.weight.split(8)
    bq, bk, bv = attn.qkv.bias.split(8)
    want = torch.zeros_like(got)
    for b, n in enumerate(lengths):
        heads = []
        for head in range(2):
            rows = slice(4 * head, 4 * head + 4)
            q = h[b] @ wq[rows].T + bq[rows]  # (L, 4) every slot asks
            k = h[b, :n] @ wk[rows].T + bk[rows]  # (n, 4) only the real tokens answer
            v = h[b, :n] @ wv[rows].T + bv[rows]
            heads.append(torch.softmax(q @ k.T / 2.0, dim=-1) @ v)  # (L, 4)
        out = torch.cat(heads, dim=-1) @ attn.out.weight[0].T + attn.out.bias[0]  # (L, D)
        want[b] = torch.nn.functional.layer_norm(h[b] + out, (8,), block.norm_weight[0], block.norm_bias[0])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    t, packing = enc.encode(x, mask)
    torch.testing.assert_close(got[mask], t, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(got[1, 2:], torch.zeros(3, 8))  # the padded slots hold outputs, not zeros
    grid = Packing.grid(mask)
    assert grid.is_full and grid.num_tokens == 3 * L and torch.equal(grid.key_mask, mask)
    assert Packing.from_mask(mask, 3, L, "cpu").key_mask is not None and Packing.full(3, L, "cpu").key_mask is None


def test_attention_pooling_one_token_returns_it():
    pool = AttentionPooling(hidden_size=6)
    x = torch.randn(3, 1, 6)
    torch.testing.assert_close(pool(x), x[:, 0])
    torch.testing.assert_close(pool(x, torch.ones(3, 1, dtype=torch.bool)), x[:, 0])
    padded = torch.randn(2, 4, 6)
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)
    out = pool(padded, mask)
    assert out.shape == (2, 6)
    torch.testing.assert_close(out[0], padded[0, 0])


def test_attention_pooling_matches_loop_and_empty_row_is_zero():
    pool = AttentionPooling(hidden_size=4)
    x = torch.randn(3, 5, 4)
    lengths = [5, 2, 0]
    mask = torch.arange(5)[None] < torch.tensor(lengths)[:, None]
    out = pool(x, mask)
    for b, n in enumerate(lengths):
        if n == 0:
            assert torch.equal(out[b], torch.zeros(4))
            continue
        scores = torch.stack([pool.score(x[b, t]).squeeze() for t in range(n)])
        expected = (torch.softmax(scores, dim=0)[:, None] * x[b, :n]).sum(0)
        torch.testing.assert_close(out[b], expected)


def test_packing_round_trip_and_prefix_check():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    packing = Packing.from_mask(mask, 3, 3, DEVICE)
    x = torch.randn(3, 3, 2)
    packed = packing.pack(x)
    assert packed.shape == (6, 2)
    assert packing.positions.tolist() == [0, 1, 0, 0, 1, 2]
    assert torch.equal(packing.unpack(packed), x * mask[..., None])
    stacked = torch.stack([packed, 2 * packed, 3 * packed], dim=1)  # (N, 3, 2): the tokens at dim 0
    by_dim = packing.unpack(stacked.transpose(0, 1), dim=1)  # (3, B, L, 2) from (3, N, 2)
    assert torch.equal(by_dim, torch.stack([c * x * mask[..., None] for c in (1, 2, 3)]))
    full = Packing.from_mask(torch.ones(2, 3, dtype=torch.bool), 2, 3, DEVICE)
    assert full.is_full
    assert torch.equal(full.unpack(torch.arange(12.0).view(2, 6), dim=1), torch.arange(12.0).view(2, 2, 3))
    with pytest.raises(ValueError, match="real tokens first"):
        Packing.from_mask(torch.tensor([[0, 1, 1]], dtype=torch.bool), 1, 3, DEVICE)


@pytest.mark.parametrize("lengths, length", [([2, 0, 3, 1], 3), ([4, 4], 4), ([1], 5), ([0, 0], 2)])
def test_packing_from_host_lengths_equals_the_one_read_from_the_mask(lengths, length):
    mask = (torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]).to(DEVICE)  # (B, L), unmarked
    read = Packing.from_mask(mask, len(lengths), length, DEVICE)
    marked = tag_lengths(mask.clone(), np.array(lengths))
    for packing in (Packing.from_mask(marked, len(lengths), length, DEVICE), Packing.from_lengths(np.array(lengths), length, DEVICE)):
        assert (packing.batch, packing.length, packing.is_full) == (read.batch, read.length, read.is_full)
        assert packing.num_tokens == sum(lengths)
        for name in ("lengths", "positions", "index", "mask"):
            a, b = getattr(packing, name), getattr(read, name)
            assert (a is None) == (b is None), name
            if a is not None:
                assert a.device == b.device and torch.equal(a.cpu(), b.cpu()), name
    expected_positions = [t for n in lengths for t in range(n)]
    assert read.positions.tolist() == expected_positions


def test_a_marked_mask_is_taken_at_its_host_lengths_without_a_read(monkeypatch):
    import prvrlab.models.blocks as blocks

    def refuse(*args):
        raise AssertionError("read back")

    monkeypatch.setattr(blocks, "_read_layout", refuse)
    mask = prefix_mask(np.array([2, 1, 3]), 3).to(DEVICE).clone()  # a copy: the mark stays behind
    with pytest.raises(AssertionError, match="read back"):
        Packing.from_mask(mask, 3, 3, DEVICE)
    # the host's lengths are what counts (the caller vouches that the mask agrees): a wrong mark shows it
    misleading = tag_lengths(torch.ones(3, 3, dtype=torch.bool, device=DEVICE), np.array([2, 1, 3]))
    packing = Packing.from_mask(misleading, 3, 3, DEVICE)
    assert packing.positions.tolist() == [0, 1, 0, 0, 1, 2] and packing.index.tolist() == [0, 1, 3, 6, 7, 8]
    with pytest.raises(ValueError, match=r"lengths must be \(B,\) values in \[0, 3\]"):
        Packing.from_lengths(np.array([4, 1]), 3, DEVICE)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_marked_mask_packs_without_a_host_wait_on_a_gpu():
    from prvrlab.data.batch import mask_to

    cuda = torch.device("cuda")
    mask = mask_to(prefix_mask(np.array([2, 0, 3]), 3), cuda)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any wait for the GPU raises
    try:
        packing = Packing.from_mask(mask, 3, 3, cuda)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert packing.positions.tolist() == [0, 1, 0, 1, 2] and packing.index.tolist() == [0, 1, 6, 7, 8]


def test_input_projection_and_positional_embedding():
    proj = InputProjection(in_dim=5, out_dim=4, dropout=0.0)
    y = proj(torch.randn(2, 3, 5))
    assert y.shape == (2, 3, 4) and (y >= 0).all()
    pos = PositionalEmbedding(max_len=3, hidden_size=4, dropout=0.0)
    x = torch.randn(2, 3, 4)
    packing = Packing.full(2, 3, DEVICE)
    torch.testing.assert_close(pos.forward_packed(packing.pack(x), packing), packing.pack(pos(x)))
    with pytest.raises(ValueError, match="max_len=3"):
        pos(torch.randn(1, 4, 4))
    with pytest.raises(ValueError, match="dropout"):
        InputProjection(in_dim=5, out_dim=4, dropout=-0.1)


def test_fast_dropout_statistics_gradient_and_seed():
    from prvrlab.models.blocks import Dropout, fast_dropout

    x = torch.ones(200, 500, requires_grad=True)
    torch.manual_seed(3)
    y = fast_dropout(x, 0.2, True)
    dropped = (y == 0).float().mean().item()
    assert abs(dropped - 0.2) < 0.01
    assert torch.allclose(y[y != 0], torch.tensor(1.25))
    y.sum().backward()
    assert torch.equal(x.grad, y.detach())  # d(x * keep)/dx = keep
    torch.manual_seed(3)
    assert torch.equal(fast_dropout(x, 0.2, True), y)
    assert fast_dropout(x, 0.2, False) is x
    layer = Dropout(0.3).eval()
    assert layer(x) is x
    with pytest.raises(ValueError, match="attention_dropout"):
        Dropout(1.0, name="attention_dropout")


def test_branch_layer_norm_equals_the_formula_per_branch_with_its_own_affine():
    """branch_layer_norm: (x - mean) / sqrt(var + eps) * w_k + b_k over the last dim, branch k with its own
    affine (float64 formula); weight and bias gradients equal the formula's."""
    torch.manual_seed(0)
    x = torch.randn(3, 5, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    got = branch_layer_norm(x, w, b)
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)  # biased, as LayerNorm
    want = (x - mean) / torch.sqrt(var + 1e-5) * w[:, None, :] + b[:, None, :]
    torch.testing.assert_close(got, want)
    probe = torch.randn_like(want)
    grads = torch.autograd.grad((got * probe).sum(), (x, w, b))
    expected = torch.autograd.grad((want * probe).sum(), (x, w, b))
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
def test_project_with_autograd_in_bf16_equals_the_layer_forward_and_backward():
    """project() under bf16 autocast with autograd (one oneDNN call with the bias inside, addmm's backward)
    gives exactly F.linear's Q/K/V blocks and the gradients of the input, weight and bias."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 96)
    x0 = torch.randn(2, 19, 64)  # leading dims flattened and restored
    probes = [torch.randn(2, 19, 32) for _ in range(3)]
    runs = []
    for fn in (lambda x: project(layer, x, 3), lambda x: layer(x).chunk(3, -1)):
        x = x0.clone().requires_grad_(True)
        layer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn(x)
        sum((o.float() * p).sum() for o, p in zip(out, probes)).backward()
        runs.append([*(o.detach() for o in out), x.grad, layer.weight.grad.clone(), layer.bias.grad.clone()])
    for got, want in zip(*runs):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("x_shape", [(50, 16), (3, 50, 16)])
def test_residual_dropout_is_addcmul_with_a_one_pass_backward(dtype, x_shape):
    """residual_dropout(x, a, mask): addcmul's values and gradients exactly, x broadcast or not."""
    torch.manual_seed(5)
    x0, a0 = torch.randn(*x_shape, dtype=dtype), torch.randn(3, 50, 16, dtype=dtype)
    mask, probe = dropout_mask(a0, 0.25), torch.randn(3, 50, 16, dtype=dtype)
    assert 0 < int((mask == 0).sum()) < mask.numel()
    runs = []
    for fn in (residual_dropout, torch.addcmul):
        x, a = x0.clone().requires_grad_(True), a0.clone().requires_grad_(True)
        y = fn(x, a, mask)
        runs.append((y.detach(), *torch.autograd.grad((y * probe).sum(), (x, a))))
    for got, want in zip(*runs):
        assert got.shape == want.shape and torch.equal(got, want)
    assert torch.equal(runs[0][2], (probe * mask))  # a's gradient: the probe through the mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("widths", [(24, 96), (96, 24)], ids=["narrow-output", "wide-output"])
def test_weight_grad_is_g_transposed_times_x_contiguous_in_either_orientation(dtype, widths):
    from prvrlab.models.blocks import weight_grad

    g_gen = torch.Generator().manual_seed(3)
    n_out, n_in = widths
    g = torch.randn(300, n_out, generator=g_gen).to(dtype)  # (M, out)
    x = torch.randn(300, n_in, generator=g_gen).to(dtype)  # (M, in)
    want = g.double().t() @ x.double()  # (out, in): exact products of the stored values
    got = weight_grad(g, x)
    out = torch.full((n_out, n_in), float("nan"), dtype=dtype)
    into = weight_grad(g, x, out=out)
    assert got.shape == (n_out, n_in) and got.dtype == dtype and got.is_contiguous()
    assert into is out and torch.equal(out, got)
    # float32 sums of 300 products, then (bf16) one rounding of the result
    rel = 2**-8 if dtype == torch.bfloat16 else 1e-5
    assert ((got.double() - want).abs() <= rel * want.abs() + 1e-4 * want.abs().max()).all()


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16-autocast"])
def test_relu_ffn_gives_the_sequentials_forward_and_its_gradients(amp):
    """blocks.relu_ffn on a Linear -> ReLU -> Dropout -> Linear FFN (ffn_inner's layout): the forward of the
    nn.Sequential bit for bit after the same generator state (the same dropout mask), the gradients of the
    input and every parameter to 1e-6 in float32 and to a bf16 rounding under bf16 autocast; a GELU FFN and
    inference run the Sequential itself."""
    from torch import nn

    from prvrlab.models.blocks import relu_ffn
    from prvrlab.models.gmm import ffn_inner

    torch.manual_seed(0)
    ffn = nn.Sequential(nn.Linear(16, 64), ffn_inner("relu", 0.3), nn.Linear(64, 16)).train()
    x = torch.randn(50, 16)
    weights = torch.linspace(-1, 1, 50 * 16).view(50, 16)

    def run(fn):
        torch.manual_seed(7)
        leaf = x.clone().requires_grad_()
        ffn.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            y = fn(leaf)
        (y.float() * weights).sum().backward()
        return y.detach(), [leaf.grad] + [p.grad.clone() for p in ffn.parameters()]

    want_y, want_grads = run(ffn)
    got_y, got_grads = run(lambda v: relu_ffn(ffn, v))
    assert got_y.dtype == want_y.dtype and torch.equal(got_y, want_y)
    tol = 2**-7 if amp else 1e-6
    for got, want in zip(got_grads, want_grads):
        assert float((got - want).abs().max()) <= tol * max(1.0, float(want.abs().max()))
    torch.manual_seed(1)
    y = relu_ffn(ffn, x.requires_grad_())
    assert y.grad_fn.next_functions[0][0].name() == "_BranchGemmsBackward"  # (N, out) row 0 of one branch
    gelu = nn.Sequential(nn.Linear(16, 64), ffn_inner("gelu", 0.3), nn.Linear(64, 16))
    assert relu_ffn(gelu, x).grad_fn.name() == ffn(x).grad_fn.name() == "AddmmBackward0"
    for other in (nn.Sequential(nn.Linear(16, 16), nn.ReLU()), nn.Linear(16, 16)):  # not three parts: as they are
        torch.manual_seed(3)
        a = relu_ffn(other, x)
        torch.manual_seed(3)
        assert torch.equal(a, other(x))
