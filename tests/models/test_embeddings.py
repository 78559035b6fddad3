"""VideoEmbedding / QueryEmbedding concatenation: zero/False padding to the longest part, torch.cat's
type promotion, one copy of each part; a float32 result of bf16 parts equals the parts cast one by one."""

from __future__ import annotations

import pytest
import torch

from prvrlab.models.base import QueryEmbedding, RowBuffer, VideoEmbedding


def part(n: int, length: int, dtype=torch.float32, seed: int = 0) -> VideoEmbedding:
    g = torch.Generator().manual_seed(seed)
    mask = torch.arange(length)[None] < torch.randint(1, length + 1, (n,), generator=g)[:, None]  # (n, L)
    frame = (torch.randn(n, length, 4, generator=g) * mask[..., None]).to(dtype)  # (n, L, 4)
    return VideoEmbedding(clip=torch.randn(n, 3, 4, generator=g).to(dtype), frame=frame, frame_mask=mask,
                          extra={"frame_norm": torch.rand(n, length, generator=g)})


def hand_cat(tensors: list[torch.Tensor], fill) -> torch.Tensor:
    """Row by row into a list, each row padded with ``fill`` to the longest."""
    length = max(t.shape[1] for t in tensors)
    rows = []
    for t in tensors:
        for row in t:
            pad = torch.full((length - row.shape[0], *row.shape[1:]), fill, dtype=row.dtype)
            rows.append(torch.cat([row, pad]))
    return torch.stack(rows)


def test_cat_pads_every_field_to_the_longest_part():
    parts = [part(2, 5, seed=1), part(3, 7, seed=2), part(1, 4, seed=3)]
    whole = VideoEmbedding.cat(parts)
    assert torch.equal(whole.frame, hand_cat([p.frame for p in parts], 0.0))
    assert torch.equal(whole.frame_mask, hand_cat([p.frame_mask for p in parts], False))
    assert torch.equal(whole.extra["frame_norm"], hand_cat([p.extra["frame_norm"] for p in parts], 0.0))
    assert torch.equal(whole.clip, torch.cat([p.clip for p in parts]))  # same shapes: plain cat
    queries = QueryEmbedding.cat([QueryEmbedding(vectors={"clip": torch.ones(2, 4)}),
                                  QueryEmbedding(vectors={"clip": torch.zeros(3, 4)})])
    assert queries.vectors["clip"].shape == (5, 4) and queries.vectors["clip"][:2].eq(1).all()


def test_cat_promotes_like_torch_cat_and_refuses_other_trailing_shapes():
    low, high = part(2, 5, torch.bfloat16, seed=1), part(3, 7, seed=2)
    whole = VideoEmbedding.cat([low, high])
    assert whole.frame.dtype == torch.float32  # a bf16 part never rounds a float32 one
    assert torch.equal(whole.frame, hand_cat([low.frame.float(), high.frame], 0.0))
    bf16 = VideoEmbedding.cat([low, part(3, 7, torch.bfloat16, seed=2)])
    assert bf16.frame.dtype == torch.bfloat16
    other = part(1, 6, seed=3)
    other.frame = torch.zeros(1, 6, 5)
    with pytest.raises(ValueError, match="cannot concatenate"):
        VideoEmbedding.cat([high, other])


def buffered(parts: list[VideoEmbedding], rows: int) -> tuple[VideoEmbedding, RowBuffer]:
    buffer = RowBuffer(rows)
    for p in parts:
        buffer.add(p)
    return buffer.result(), buffer


def assert_hand_cat(whole: VideoEmbedding, parts: list[VideoEmbedding]) -> None:
    assert torch.equal(whole.frame, hand_cat([p.frame for p in parts], 0.0))
    assert torch.equal(whole.frame_mask, hand_cat([p.frame_mask for p in parts], False))
    assert torch.equal(whole.extra["frame_norm"], hand_cat([p.extra["frame_norm"] for p in parts], 0.0))
    assert torch.equal(whole.clip, torch.cat([p.clip for p in parts]))


def test_row_buffer_writes_parts_longest_first_into_one_allocation():
    parts = [part(3, 7, torch.bfloat16, seed=1), part(2, 5, torch.bfloat16, seed=2), part(1, 4, torch.bfloat16, seed=3)]
    whole, buffer = buffered(parts, 6)
    assert buffer.parts is None  # no part kept: each was copied into the gallery allocated at the first
    assert whole.frame.dtype == torch.bfloat16 and whole.frame.shape == (6, 7, 4)
    assert_hand_cat(whole, parts)
    fewer, _ = buffered(parts[:2], 6)  # fewer rows than announced: the filled ones
    assert_hand_cat(fewer, parts[:2])
    assert RowBuffer(4).result() is None


def test_row_buffer_falls_back_to_cat_for_a_part_that_does_not_fit():
    short, long_ = part(2, 5, seed=1), part(3, 7, seed=2)
    whole, buffer = buffered([short, long_], 5)  # a longer part after a shorter one
    assert buffer.parts is not None and buffer.out is None
    assert_hand_cat(whole, [short, long_])
    whole, _ = buffered([long_, short], 4)  # rows beyond the announced number
    assert_hand_cat(whole, [long_, short])
    low = part(2, 5, torch.bfloat16, seed=3)
    whole, _ = buffered([long_, low], 5)  # another dtype: torch.cat's promotion, as VideoEmbedding.cat
    assert whole.frame.dtype == torch.float32
    assert torch.equal(whole.frame, hand_cat([long_.frame, low.frame.float()], 0.0))
    other = part(1, 4, seed=4)
    other.extra = {"frame_norm": other.extra["frame_norm"], "more": torch.zeros(1)}  # another structure
    buffer = RowBuffer(4)
    buffer.add(long_)
    buffer.add(other)
    assert buffer.parts is not None and buffer.filled == 3  # no longer written: concatenated at the end


def test_row_buffer_writes_per_video_values_and_without_a_row_count_concatenates():
    """A (Nv,) tensor (a per-video value in ``extra``) is written row by row like the others; without a
    row count the buffer is a list concatenated at the end."""
    parts = [part(3, 7, seed=1), part(2, 5, seed=2)]
    for i, p in enumerate(parts):
        p.extra["length"] = p.frame_mask.sum(dim=1) + 10 * i  # (n,)
    whole, buffer = buffered(parts, 5)
    assert buffer.parts is None
    assert_hand_cat(whole, parts)
    assert torch.equal(whole.extra["length"], torch.cat([p.extra["length"] for p in parts]))
    listed, buffer = buffered(parts, None)
    assert buffer.out is None and len(buffer.parts) == 2
    assert_hand_cat(listed, parts)
