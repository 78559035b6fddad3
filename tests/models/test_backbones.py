"""Contract tests run on every registered backbone, plus GMMFormer specifics."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
import yaml

from prvrlab.data.batch import Batch, tag_lengths
from prvrlab.models.base import ModelOutput, QueryEmbedding, RetrievalModel, VideoEmbedding
from prvrlab.models.component import WORD_TOKENS
from prvrlab.registry import BACKBONES
from device_under_test import DEVICE

VIDEO_DIM, QUERY_DIM, NUM_CLIPS = 12, 10, 8
# Small values for whichever of these parameters a backbone has.
TINY = {
    "hidden_size": 16,
    "num_heads": 2,
    "num_gmm_blocks": 1,
    "max_frames": 16,
    "max_query_len": 8,
}


def build(name: str, **overrides) -> RetrievalModel:
    params = BACKBONES.params(name)
    kwargs = {k: v for k, v in {**TINY, **overrides}.items() if k in params}
    return BACKBONES.build(name, video_dim=VIDEO_DIM, query_dim=QUERY_DIM, **kwargs)


def make_batch(
    frame_lengths: list[int],
    query_lengths: list[int],
    query_video: list[int],
    *,
    frame_pad: int = 0,
    query_pad: int = 0,
    seed: int = 0,
) -> Batch:
    """Random features; padded positions hold garbage (a model must ignore them)."""
    g = torch.Generator(DEVICE).manual_seed(seed)
    B, Nq = len(frame_lengths), len(query_lengths)
    Lf, Lq = max(frame_lengths) + frame_pad, max(query_lengths) + query_pad
    frame_mask = torch.arange(Lf)[None] < torch.tensor(frame_lengths)[:, None]
    query_mask = torch.arange(Lq)[None] < torch.tensor(query_lengths)[:, None]
    return Batch(
        frames=torch.randn(B, Lf, VIDEO_DIM, generator=g),
        frame_mask=frame_mask,
        clips=torch.randn(B, NUM_CLIPS, VIDEO_DIM, generator=g),
        queries=torch.randn(Nq, Lq, QUERY_DIM, generator=g),
        query_mask=query_mask,
        query_video=torch.tensor(query_video),
        video_ids=[f"v{i}" for i in range(B)],
        query_ids=[f"q{i}" for i in range(Nq)],
    )


def with_padding(batch: Batch, frame_pad: int, query_pad: int) -> Batch:
    """The same batch with extra padded (garbage) frames and tokens appended."""
    g = torch.Generator(DEVICE).manual_seed(123)
    B, Lf, Dv = batch.frames.shape
    Nq, Lq, Dq = batch.queries.shape
    return Batch(
        frames=torch.cat([batch.frames, torch.randn(B, frame_pad, Dv, generator=g)], dim=1),
        frame_mask=torch.cat([batch.frame_mask, torch.zeros(B, frame_pad, dtype=torch.bool)], dim=1),
        clips=batch.clips,
        queries=torch.cat([batch.queries, torch.randn(Nq, query_pad, Dq, generator=g)], dim=1),
        query_mask=torch.cat([batch.query_mask, torch.zeros(Nq, query_pad, dtype=torch.bool)], dim=1),
        query_video=batch.query_video,
        video_ids=batch.video_ids,
        query_ids=batch.query_ids,
    )


def standard_batch() -> Batch:
    return make_batch([7, 3, 1, 5], [4, 2, 6, 1, 3, 5, 2], [0, 0, 1, 2, 2, 2, 3])


def training_total(out: ModelOutput) -> torch.Tensor:
    """Every training score summed (sims and logits): a scalar that reaches every scoring parameter.
    ``fuse`` is for retrieval scores; a training branch may have other columns (``targets``)."""
    return sum(s.sim.sum() + (0.0 if s.logits is None else s.logits.sum()) for s in out.scores.values())


NAMES = BACKBONES.names()
# the shipped backbones, all built of InputProjection, packed layers and a query encoder: a test of those parts
# skips another backbone that lacks them, never one of these
BUILT_IN = ("arl", "gmmformer", "gmmformer_v2", "ice_base", "mamfusion", "mssl")


def test_gmmformer_is_registered():
    assert "gmmformer" in NAMES


@pytest.mark.parametrize("name", NAMES)
def test_forward_shapes_finite_and_gradients(name):
    model = build(name).train()
    batch = standard_batch()
    out = model(batch)
    assert isinstance(out, ModelOutput)
    assert isinstance(out.query, QueryEmbedding) and isinstance(out.video, VideoEmbedding)
    assert set(model.score_weights) <= set(out.scores)
    nq, nv = batch.num_queries, batch.num_videos
    loss = training_total(out)
    for branch, scores in out.scores.items():
        columns = nv if scores.targets is None else nq  # targets: one positive column per query
        assert scores.sim.shape == (nq, columns), branch
        if scores.targets is not None:
            assert scores.targets.shape == (nq,) and int(scores.targets.max()) < columns, branch
        assert torch.isfinite(scores.sim).all(), branch
        assert (scores.sim.abs() <= 1 + 1e-5).all(), f"{branch}: sim must be a cosine"
        if scores.logits is not None:
            assert scores.logits.shape == (nq, columns)
            assert torch.isfinite(scores.logits).all()
    for vector in out.query.vectors.values():
        assert vector.shape[0] == nq
    loss.backward()
    for pname, param in model.named_parameters():
        assert param.grad is not None, f"{pname} received no gradient"
        assert torch.isfinite(param.grad).all(), pname


@pytest.mark.parametrize("name", NAMES)
def test_masks_marked_with_host_lengths_are_never_read_back(name, monkeypatch):
    """A batch whose masks carry the host's lengths (as the loaders' do) trains with no read of a mask's
    layout from the device, and gives exactly what the same masks read back give."""

    import prvrlab.models.blocks as blocks

    model = build(name).eval()
    bare = standard_batch()
    marked = dataclasses.replace(
        bare,
        frame_mask=tag_lengths(bare.frame_mask.clone(), np.array([7, 3, 1, 5])),
        query_mask=tag_lengths(bare.query_mask.clone(), np.array([4, 2, 6, 1, 3, 5, 2])),
    )
    with torch.no_grad():
        expected = model(bare)

    def refuse(*args):
        raise AssertionError("a marked mask was read back from its device")

    monkeypatch.setattr(blocks, "_read_layout", refuse)
    try:
        with torch.no_grad():
            model(bare)
    except AssertionError:
        pass  # it reads unmarked masks back: the check below means something
    else:
        if name in BUILT_IN:
            raise AssertionError(f"{name} read no mask back: the spy on blocks._read_layout no longer sees the reads")
        pytest.skip(f"{name} never reads a mask's layout back (no packed layers)")
    with torch.no_grad():
        got = model(marked)
    for branch in expected.scores:
        torch.testing.assert_close(got.scores[branch].sim, expected.scores[branch].sim, atol=0, rtol=0)
    model.train()
    training_total(model(marked)).backward()
    with pytest.raises(AssertionError, match="read back"):
        model(bare)


@pytest.mark.parametrize("name", NAMES)
def test_padding_does_not_change_scores(name):
    model = build(name).eval()
    batch = standard_batch()
    padded = with_padding(batch, frame_pad=5, query_pad=2)
    with torch.no_grad():
        a = model.score(
            model.encode_queries(batch.queries, batch.query_mask),
            model.encode_videos(batch.clips, batch.frames, batch.frame_mask),
            with_logits=True,
        )
        b = model.score(
            model.encode_queries(padded.queries, padded.query_mask),
            model.encode_videos(padded.clips, padded.frames, padded.frame_mask),
            with_logits=True,
        )
    for branch in a:
        torch.testing.assert_close(a[branch].sim, b[branch].sim, atol=1e-5, rtol=1e-5)
        if a[branch].logits is not None:
            torch.testing.assert_close(a[branch].logits, b[branch].logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_scoring_in_one_call_equals_separate_calls(name):
    model = build(name).eval()
    batch = standard_batch()
    with torch.no_grad():
        video = model.encode_videos(batch.clips, batch.frames, batch.frame_mask)
        query = model.encode_queries(batch.queries, batch.query_mask)
        full = model.score(query, video, with_logits=True)
        per_video = [
            model.score(query, video.index(slice(v, v + 1)), with_logits=True) for v in range(batch.num_videos)
        ]
        per_query = [
            model.score(query.index(slice(i, i + 1)), video, with_logits=True) for i in range(batch.num_queries)
        ]
    for branch, scores in full.items():
        torch.testing.assert_close(scores.sim, torch.cat([s[branch].sim for s in per_video], dim=1))
        torch.testing.assert_close(scores.sim, torch.cat([s[branch].sim for s in per_query], dim=0))
        if scores.logits is not None:
            torch.testing.assert_close(scores.logits, torch.cat([s[branch].logits for s in per_video], dim=1))
            torch.testing.assert_close(scores.logits, torch.cat([s[branch].logits for s in per_query], dim=0))
        # without logits the similarities are the same
        assert model.score(query, video)[branch].logits is None
        torch.testing.assert_close(model.score(query, video)[branch].sim, scores.sim)


@pytest.mark.parametrize("name", NAMES)
def test_one_video_one_query_keeps_batch_dims(name):
    model = build(name).eval()
    batch = make_batch([1], [1], [0])
    with torch.no_grad():
        out = model(batch)
    for vector in out.query.vectors.values():
        assert vector.dim() == 2 and vector.shape[0] == 1
    for scores in out.scores.values():
        assert scores.sim.shape == (1, 1)
    retrieval = model.score(dataclasses.replace(out.query, own_video=None), out.video)
    assert model.fuse(retrieval).shape == (1, 1)


@pytest.mark.parametrize("name", NAMES)
def test_bf16_autocast_forward_is_finite(name):
    model = build(name).train()
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        out = model(standard_batch())
        loss = training_total(out)
    loss.backward()
    for scores in out.scores.values():
        assert scores.sim.dtype == torch.float32 and torch.isfinite(scores.sim).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


# ---------------------------------------------------------------- GMMFormer specifics


def test_gmmformer_sigmas_accept_inf_spellings():
    from_yaml = yaml.safe_load("[0.5, 1, 5, .inf]")
    assert math.isinf(from_yaml[-1])
    for sigmas in (from_yaml, [0.5, 1, 5, "inf"], (0.5, math.inf)):
        model = build("gmmformer", sigmas=sigmas)
        assert math.isinf(model.sigmas[-1])
        assert model.clip.layers[0].sigmas == model.sigmas


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"sigmas": [1.0, -2.0]}, "sigmas"),
        ({"sigmas": []}, "sigmas"),
        ({"sigmas": [1.0, "wide"]}, "sigmas"),
        ({"sigmas": [float("nan")]}, "sigmas"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"hidden_size": 10, "num_heads": 4}, "num_heads"),
        ({"dropout": 1.5}, "dropout"),
        ({"num_gmm_blocks": 0}, "num_gmm_blocks"),
        ({"max_frames": -1}, "max_frames"),
        ({"clip_weight": -0.1}, "clip_weight"),
        ({"clip_weight": 0.0, "frame_weight": 0.0}, "score weights"),
    ],
)
def test_gmmformer_rejects_bad_hyperparameters(kwargs, param):
    with pytest.raises(ValueError, match=param):
        build("gmmformer", **kwargs)


def test_gmmformer_score_weights_and_fuse():
    model = build("gmmformer", clip_weight=0.6, frame_weight=0.4).eval()
    assert model.score_weights == {"clip": 0.6, "frame": 0.4}
    with torch.no_grad():
        out = model(standard_batch())
    expected = 0.6 * out.scores["clip"].sim + 0.4 * out.scores["frame"].sim
    torch.testing.assert_close(model.fuse(out.scores), expected)


def test_gmmformer_scores_match_their_definition():
    model = build("gmmformer").eval()
    batch = standard_batch()
    with torch.no_grad():
        out = model(batch)
    q = out.query.vectors["clip"]
    assert q is out.query.vectors["frame"]
    for i in range(batch.num_queries):
        for v in range(batch.num_videos):
            clips = out.video.clip[v]
            cos = torch.nn.functional.cosine_similarity(q[i][None], clips, dim=-1)
            assert math.isclose(out.scores["clip"].sim[i, v].item(), cos.max().item(), abs_tol=1e-5)
            assert math.isclose(out.scores["clip"].logits[i, v].item(), (clips @ q[i]).max().item(), abs_tol=1e-4)
            frame = out.video.frame[v]
            cos_f = torch.nn.functional.cosine_similarity(q[i], frame, dim=0)
            assert math.isclose(out.scores["frame"].sim[i, v].item(), cos_f.item(), abs_tol=1e-5)
            assert math.isclose(out.scores["frame"].logits[i, v].item(), (q[i] @ frame).item(), abs_tol=1e-4)


def test_gmmformer_init_is_normal_002():
    model = build("gmmformer", hidden_size=64, num_heads=4)
    w = model.clip.layers[0].attention.qkv.weight
    assert abs(w.std().item() - 0.02) < 0.002
    assert torch.count_nonzero(model.clip.layers[0].attention.qkv.bias) == 0
    assert abs(model.frame.layers[0].attention.out.weight.std().item() - 0.02) < 0.002


def test_gmmformer_too_many_frames_is_a_clear_error():
    model = build("gmmformer", max_frames=16)
    batch = make_batch([20, 3], [2], [0])
    with pytest.raises(ValueError, match="max_len=16"):
        model(batch)


@pytest.mark.parametrize("name", NAMES)
def test_bf16_autocast_scores_track_fp32(name):
    model = build(name).eval()
    batch = standard_batch()
    with torch.no_grad():
        ref = model(batch).scores
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            low = model(batch).scores
    for branch in ref:
        torch.testing.assert_close(low[branch].sim, ref[branch].sim, atol=0.05, rtol=0.05)


def test_gmmformer_with_feed_forward_sublayers():
    model = build("gmmformer", ffn_size=24).train()
    assert model.clip.layers[0].ffn is not None and model.query.layers[0].ffn is not None
    out = model(standard_batch())
    model.fuse(out.scores).sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert build("gmmformer").clip.layers[0].ffn is None  # the reference has none


def ffn_widths(model: RetrievalModel) -> list[int]:
    """The feed-forward width of every attention layer of ``model`` (0: the layer has none)."""
    from prvrlab.models.gmm import GMMBlock
    from prvrlab.models.gmmformer_v2 import TCGMMBlock

    widths = []
    for module in model.modules():
        if isinstance(module, GMMBlock):  # TransformerLayer included
            widths.append(0 if module.ffn is None else module.ffn[0].out_features)
        elif isinstance(module, TCGMMBlock):
            widths.append(module.ffn_in.weight.shape[1])  # (K, F, D)
    return widths


@pytest.mark.parametrize("name", [n for n in NAMES if "ffn_size" in BACKBONES.params(n)])
def test_ffn_size_means_the_same_in_every_backbone(name):
    hidden = TINY["hidden_size"]
    counts = {len(ffn_widths(build(name, ffn_size=size))) for size in (None, 24)}
    assert len(counts) == 1 and counts.pop() >= 2  # query and video encoders (clip and frame: 3; arl: 2)
    assert set(ffn_widths(build(name, ffn_size=None))) == {4 * hidden}
    assert set(ffn_widths(build(name, ffn_size=24))) == {24}
    if name == "gmmformer_v2":  # a TC-GMMBlock always has its feed-forward sublayer
        with pytest.raises(ValueError, match="ffn_size"):
            build(name, ffn_size=0)
    else:
        assert set(ffn_widths(build(name, ffn_size=0))) == {0}
    with pytest.raises(ValueError, match="ffn_size"):
        build(name, ffn_size=-1)


def with_word_encoder(name: str) -> RetrievalModel:
    """``build(name)``; skips a backbone without a query encoder to copy (``fresh_word_encoder`` refuses it, and
    so does a component that needs one, at config validation)."""
    model = build(name)
    query = getattr(model, "query", None)
    if name not in BUILT_IN and (not isinstance(query, torch.nn.Module) or not hasattr(query, "encode")):
        pytest.skip(f"{name} has no query encoder with encode() to copy")
    return model


@pytest.mark.parametrize("name", NAMES)
def test_fresh_word_encoder_can_share_the_positional_embedding(name):
    """share_positions: the copy's ``pos`` is the backbone's module itself; every other parameter is new."""
    model = with_word_encoder(name)
    fresh = model.fresh_word_encoder(share_positions=True)
    assert fresh.pos is model.query.pos
    mine = {id(p) for p in fresh.parameters()}
    theirs = {id(p) for p in model.query.parameters()}
    assert mine & theirs == {id(p) for p in model.query.pos.parameters()}
    assert model.fresh_word_encoder().pos is not model.query.pos


@pytest.mark.parametrize("name", NAMES)
def test_fresh_word_encoder_gives_word_tokens_like_the_backbones(name):
    """RetrievalModel.fresh_word_encoder: the query encoder's layout, no head, drawn anew: tokens of the same
    shape as the backbone's word tokens, different values."""
    model = with_word_encoder(name).eval()
    model.request(retrieval={WORD_TOKENS})
    batch = standard_batch()
    fresh = model.fresh_word_encoder().eval()
    assert fresh.pool is None
    with torch.no_grad():
        t, packing = fresh.encode(batch.queries, batch.query_mask)
        mine = packing.unpack(t)
        theirs = model.encode_queries(batch.queries, batch.query_mask).tokens
    assert mine.shape == theirs.shape and not torch.allclose(mine, theirs)
    assert torch.equal(packing.mask, batch.query_mask)


@pytest.mark.parametrize("name", NAMES)
def test_indexed_gallery_scores_equal_the_plain_gallery(name):
    """RetrievalModel.index_videos (what evaluation reuses across query chunks, e.g. the token norms of
    max-scored fields): the indexed gallery scores like the plain one, and indexing it again is a no-op."""
    model = build(name).eval()
    batch = standard_batch()
    with torch.inference_mode():
        video = model.encode_videos(batch.clips, batch.frames, batch.frame_mask)
        query = model.encode_queries(batch.queries, batch.query_mask)
        index = model.index_videos(video)
        assert model.index_videos(index) is index
        indexed, plain = model.score(query, index), model.score(query, video)
    assert indexed.keys() == plain.keys()
    for branch in plain:
        torch.testing.assert_close(indexed[branch].sim, plain[branch].sim, atol=1e-6, rtol=1e-6)
