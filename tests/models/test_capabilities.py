"""Every backbone supplies each capability it provides, with the batch's shapes and padding, when asked."""

from __future__ import annotations

import pytest
import torch
from test_backbones import NAMES, NUM_CLIPS, build, make_batch

from prvrlab.models.component import FRAME_TOKENS, MOMENT_TOKENS, WORD_TOKENS
from prvrlab.models.window_best import num_proposals
from prvrlab.registry import BACKBONES

CASES = [(name, cap) for name in NAMES for cap in sorted(BACKBONES.get(name).provides)]
FRAME_LENGTHS, QUERY_LENGTHS, QUERY_VIDEO = [7, 3, 1, 5], [4, 2, 6, 1, 3, 5, 2], [0, 0, 1, 2, 2, 2, 3]


def padded_batch():
    """Padding in every row but one, plus trailing columns that are padding in every row."""
    return make_batch(FRAME_LENGTHS, QUERY_LENGTHS, QUERY_VIDEO, frame_pad=2, query_pad=1)


def encode(model, batch, *, training: bool):
    model.train(training)
    with torch.no_grad():
        return (
            model.encode_videos(batch.clips, batch.frames, batch.frame_mask),
            model.encode_queries(batch.queries, batch.query_mask),
        )


def expected_moments(model) -> int:
    """Clip-level items per video: the clips, or MS-SL's sliding-window proposals over them."""
    max_window = getattr(model, "max_window", None)
    return NUM_CLIPS if max_window is None else num_proposals(NUM_CLIPS, max_window)


def test_every_backbone_provides_the_three_token_capabilities():
    assert {name for name, _ in CASES} == set(NAMES)
    for name in NAMES:
        assert {FRAME_TOKENS, WORD_TOKENS, MOMENT_TOKENS} <= BACKBONES.get(name).provides, name


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name, cap", CASES)
def test_requested_capability_has_the_batch_shapes_and_masks(name, cap, training):
    model = build(name)
    model.request(training={cap}, retrieval={cap})
    batch = padded_batch()
    video, query = encode(model, batch, training=training)
    D, B, Nq = model.hidden_size, batch.num_videos, batch.num_queries
    if cap == FRAME_TOKENS:
        tokens, mask = video.frame_tokens()
        Lf = max(FRAME_LENGTHS) + 2
        assert tokens.shape == (B, Lf, D)
        assert mask.dtype == torch.bool and torch.equal(mask, batch.frame_mask)
        assert mask.sum(dim=1).tolist() == FRAME_LENGTHS
        real = tokens[mask]  # (Nf, D)
        assert torch.isfinite(real).all()
        assert not torch.allclose(tokens[0, 0], tokens[0, 1])  # one embedding per frame, not a pooled copy
    elif cap == MOMENT_TOKENS:
        tokens, mask = video.moment_tokens()
        M = expected_moments(model)
        assert tokens.shape == (B, M, D)
        assert mask.dtype == torch.bool and torch.equal(mask, torch.ones(B, M, dtype=torch.bool))
        assert torch.isfinite(tokens).all()
    else:
        assert cap == WORD_TOKENS
        tokens, mask = query.word_tokens()
        Lq = max(QUERY_LENGTHS) + 1
        assert tokens.shape == (Nq, Lq, D)
        assert mask.dtype == torch.bool and torch.equal(mask, batch.query_mask)
        assert mask.sum(dim=1).tolist() == QUERY_LENGTHS
        assert torch.isfinite(tokens[mask]).all()


def pooled_frame_backbones() -> list[str]:
    """Backbones whose frame branch is one vector per video (read off an encoding, not a list)."""
    batch = padded_batch()
    return [name for name in NAMES if encode(build(name), batch, training=False)[0].frame.dim() == 2]


def test_pooled_frame_backbones_are_gmmformer_and_ice_base():
    assert {"gmmformer", "ice_base"} <= set(pooled_frame_backbones())


@pytest.mark.parametrize("name", pooled_frame_backbones())
def test_pooled_frame_branch_keeps_frame_tokens_only_on_request(name):
    model = build(name)
    batch = padded_batch()
    video, _ = encode(model, batch, training=False)  # nothing requested
    assert "frame_tokens" not in video.extra and "frame_mask" not in video.extra
    with pytest.raises(ValueError, match=FRAME_TOKENS):
        video.frame_tokens()

    model.request(training={FRAME_TOKENS})  # training only: retrieval still keeps none
    assert "frame_tokens" not in encode(model, batch, training=False)[0].extra
    assert "frame_tokens" in encode(model, batch, training=True)[0].extra
    model.eval()
    assert "frame_tokens" in model(batch).video.extra  # the training forward exposes the training set in eval mode too

    model.request(retrieval={FRAME_TOKENS})
    assert "frame_tokens" in encode(model, batch, training=False)[0].extra
    assert "frame_tokens" not in encode(model, batch, training=True)[0].extra


@pytest.mark.parametrize("name", NAMES)
def test_word_tokens_are_kept_only_on_request(name):
    """Backbones whose scores use only the query vectors keep no word tokens unless asked (an evaluation
    would hold (Nq, Lq, D) floats for nothing); the vectors do not change."""
    model = build(name)
    batch = padded_batch()
    _, query = encode(model, batch, training=False)  # nothing requested
    assert query.tokens is None and query.token_mask is None
    with pytest.raises(ValueError, match=WORD_TOKENS):
        query.word_tokens()

    model.request(training={WORD_TOKENS})  # training only: retrieval still keeps none
    assert encode(model, batch, training=False)[1].tokens is None
    kept = encode(model, batch, training=True)[1]
    assert kept.tokens is not None
    model.eval()
    assert model(batch).query.tokens is not None  # the training forward exposes the training set

    model.request(retrieval={WORD_TOKENS})
    asked = encode(model, batch, training=False)[1]
    assert asked.tokens is not None and encode(model, batch, training=True)[1].tokens is None
    for branch, vector in query.vectors.items():
        torch.testing.assert_close(asked.vectors[branch], vector, rtol=0, atol=0)
