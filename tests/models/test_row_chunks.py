"""The row-chunk kernel (prvrlab/models/row_chunks.py) and the GaussianAttention layouts that use it
(prvrlab/models/gmm.py: ``_HeadLayout``, ``_MergeHeads``): chunk moves against a hand loop, and the
kernel's layouts against PyTorch's, forward and backward, exactly."""

from __future__ import annotations

import pytest
import torch

from prvrlab.models import gmm, row_chunks

needs_kernel = pytest.mark.skipif(row_chunks.load() is None, reason="no C++ compiler to build the kernel")


@needs_kernel
@pytest.mark.parametrize("padded_dst", [True, False])
def test_chunks_move_to_their_offsets_and_padding_is_zeroed(padded_dst):
    torch.manual_seed(0)
    src = torch.randn(40)
    dst = torch.full((60,), 7.0)
    dst_base, src_base = torch.tensor([0, 30, 12]), torch.tensor([1, 20, 9])
    dst_mid, src_mid = torch.tensor([0, 6]), torch.tensor([0, 3])
    pad_base = torch.tensor([42, 50])
    chunk = 2
    want = dst.clone()
    for n in range(3):  # by hand: every (row, middle) chunk, then the padding rows' chunks
        for m in range(2):
            d, s = int(dst_base[n] + dst_mid[m]), int(src_base[n] + src_mid[m])
            want[d : d + chunk] = src[s : s + chunk]
    for p in pad_base.tolist():
        for m in dst_mid.tolist():
            want[p + m : p + m + chunk] = 0
    got = row_chunks.move_chunks(dst, src, dst_base, src_base, dst_mid, src_mid, chunk, pad_base, padded_dst=padded_dst)
    assert got is dst and torch.equal(dst, want)


@needs_kernel
def test_move_chunks_refuses_mixed_dtypes_and_strided_tensors():
    idx = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="contiguous CPU tensors of one dtype"):
        row_chunks.move_chunks(torch.zeros(4), torch.zeros(4, dtype=torch.float64), idx, idx, idx, idx, 1)
    with pytest.raises(ValueError, match="contiguous CPU tensors of one dtype"):
        row_chunks.move_chunks(torch.zeros(4, 2).t(), torch.zeros(8), idx, idx, idx, idx, 1)


def packing(lengths: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    mask = torch.arange(length)[None] < torch.tensor(lengths)[:, None]  # (B, L)
    return mask.nonzero(as_tuple=True)


def head_layout(projected: torch.Tensor, rows, positions, batch: int, length: int, weights):
    """q, k, v of ``_HeadLayout`` and the gradient of sum(weights * (q, k, v)) at ``projected``."""
    x = projected.detach().clone().requires_grad_(True)
    q, k, v = gmm._HeadLayout.apply(x, rows, positions, batch, length)
    sum((t.float() * w).sum() for t, w in zip((q, k, v), weights)).backward()
    return torch.stack([q, k, v]).detach(), x.grad


def merge_heads(heads: torch.Tensor, rows, positions, weight):
    x = heads.detach().clone().requires_grad_(True)
    out = gmm._MergeHeads.apply(x, rows, positions)
    (out.float() * weight).sum().backward()
    return out.detach(), x.grad


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_layouts_equal_pytorchs_forward_and_backward(monkeypatch, dtype):
    torch.manual_seed(1)
    lengths, L, G, Dh, K, H = [7, 3, 1, 5, 7], 7, 6, 4, 3, 2
    B = len(lengths)
    rows, positions = packing(lengths, L)
    N = rows.numel()
    projected = torch.randn(N, 3, G, Dh, dtype=dtype)
    weights = [torch.randn(B, G, L, Dh) for _ in range(3)]
    heads = torch.randn(B, K, H, L, Dh, dtype=dtype)
    merge_weight = torch.randn(K, N, H * Dh)
    fast = head_layout(projected, rows, positions, B, L, weights), merge_heads(heads, rows, positions, merge_weight)
    calls = []
    move = row_chunks.move_chunks
    monkeypatch.setattr(row_chunks, "move_chunks", lambda *a, **k: calls.append(1) or move(*a, **k))
    head_layout(projected, rows, positions, B, L, weights), merge_heads(heads, rows, positions, merge_weight)
    assert len(calls) == 1 + 3 + 1 + 1  # the kernel ran: Q/K/V forward, three gradients, merge and its backward
    monkeypatch.setattr(row_chunks, "load", lambda: None)
    plain = head_layout(projected, rows, positions, B, L, weights), merge_heads(heads, rows, positions, merge_weight)
    for got, want in zip(fast, plain):
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and torch.equal(a, b)
    q_heads = fast[0][0]  # (3, B, G, L, Dh): zeros on every padded slot, the rows on the real ones
    padded = torch.arange(L)[None] >= torch.tensor(lengths)[:, None]  # (B, L)
    assert not q_heads.permute(1, 3, 0, 2, 4)[padded].any()
    assert torch.equal(q_heads.permute(1, 3, 0, 2, 4)[rows, positions], projected)


@needs_kernel
def test_rows_outside_the_padded_layout_are_refused_before_the_kernel_writes():
    projected = torch.zeros(2, 3, 1, 2)
    for rows, positions in ((torch.tensor([0, 2]), torch.tensor([0, 1])), (torch.tensor([0, 1]), torch.tensor([0, -1]))):
        with pytest.raises(ValueError, match="outside"):
            gmm._HeadLayout.apply(projected, rows, positions, 2, 3)


@needs_kernel
def test_move_chunks_refuses_unpaired_offsets_and_chunks_outside_either_tensor_before_writing():
    """Every refused call leaves ``dst`` untouched: no offset pairing or chunk reaches past a tensor."""
    dst, src = torch.full((8,), -1.0), torch.arange(8.0)
    one, two = torch.tensor([0]), torch.tensor([0, 4])
    bad_calls = {
        "source rows": (two, one, one, one, 4, None),  # src_base shorter than dst_base
        "middle offsets": (one, one, two, one, 2, None),  # src_mid shorter than dst_mid
        "destination chunk": (torch.tensor([4]), one, one, one, 8, None),  # 4..11 of 8
        "source chunk": (one, torch.tensor([6]), one, one, 4, None),  # 6..9 of 8
        "padding chunk": (one, one, one, one, 4, torch.tensor([-1])),  # -1..2: before the start
        "chunk must be": (one, one, one, one, -1, None),
    }
    for what, (dst_base, src_base, dst_mid, src_mid, chunk, pad) in bad_calls.items():
        with pytest.raises(ValueError, match=what):
            row_chunks.move_chunks(dst, src, dst_base, src_base, dst_mid, src_mid, chunk, pad)
        assert (dst == -1).all()
    row_chunks.move_chunks(dst, src, torch.tensor([4]), torch.tensor([0]), one, one, 4)  # the last chunk fits
    assert dst.tolist() == [-1.0] * 4 + [0.0, 1.0, 2.0, 3.0]


@needs_kernel
def test_a_head_layout_refuses_a_projection_whose_rows_are_not_the_packings_tokens():
    rows, positions = packing([2, 1], 3)  # 3 tokens
    for tokens in (2, 4):
        with pytest.raises(ValueError, match=f"{tokens} projected tokens for a packing of 3"):
            gmm._HeadLayout.apply(torch.zeros(tokens, 3, 1, 2), rows, positions, 2, 3)
    with pytest.raises(ValueError, match="5 projected tokens for a packing of 6"):
        gmm._HeadLayout.apply(torch.zeros(5, 3, 1, 2), None, None, 2, 3)


def test_gather_rows_bf16_is_index_select_then_the_cast_bit_for_bit():
    """row_chunks.gather_rows_bf16: float32 rows gathered and rounded to bf16 in one pass, the values of
    index_select followed by .to(bfloat16): ties to even, NaN, infinities, signed zeros, subnormals; rows of
    both threads; indices outside the source refused; what it cannot take left to the caller (None)."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(300, 3, 47, generator=gen) * 1e3
    x[0, 0, :8] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-40, -1e-39, 3e38])
    # exact ties between two bf16 values (the low 16 bits 0x8000): rounded to the even one
    x[1, 0, :4] = torch.tensor([0x3F808000, 0x3F818000, -0x40808000 & 0xFFFFFFFF, 0x00018000], dtype=torch.int64).to(torch.int32).view(torch.float32)
    index = torch.randint(0, 300, (257,), generator=gen)
    index[:3] = torch.tensor([0, 1, 299])
    got = row_chunks.gather_rows_bf16(x, index)
    want = x.index_select(0, index).to(torch.bfloat16)
    assert got.shape == want.shape == (257, 3, 47) and got.dtype == torch.bfloat16
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan) and torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))
    assert row_chunks.gather_rows_bf16(x, index[:0]).shape == (0, 3, 47)
    with pytest.raises(ValueError, match="outside"):
        row_chunks.gather_rows_bf16(x, torch.tensor([300]))
    assert row_chunks.gather_rows_bf16(x.double(), index) is None
    assert row_chunks.gather_rows_bf16(x.transpose(1, 2), index) is None  # not contiguous
    assert row_chunks.gather_rows_bf16(x.clone().requires_grad_(), index) is None


def test_an_encoders_input_is_packed_and_cast_as_autocast_would_cast_it():
    """Packing.pack_input under bf16 autocast: the packed float32 rows cast to bf16 (one pass on a CPU), the
    same values as pack() then the cast; without autocast, pack() itself."""
    from prvrlab.models.blocks import Packing

    x = torch.randn(4, 6, 10)
    mask = torch.arange(6)[None] < torch.tensor([6, 2, 5, 1])[:, None]
    packing = Packing.from_mask(mask, 4, 6, "cpu")
    assert torch.equal(packing.pack_input(x), packing.pack(x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = packing.pack_input(x)
    assert got.dtype == torch.bfloat16 and torch.equal(got, packing.pack(x).to(torch.bfloat16))
