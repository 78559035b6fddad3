"""MS-SL specifics: proposals against a brute-force loop, scores against their per-pair definition, and the
retrieval shortcuts (proposal dots through the clip items, the indexed gallery) against the plain paths."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from test_backbones import build, make_batch, standard_batch

import prvrlab.models.mssl as mssl
from prvrlab.models.component import MOMENT_TOKENS
from prvrlab.models.mssl import sliding_window_proposals
from prvrlab.models.window_best import num_proposals


def loop_proposals(x: torch.Tensor, max_window: int) -> torch.Tensor:
    out = []
    for b in range(x.shape[0]):
        rows = []
        for k in range(1, min(max_window, x.shape[1]) + 1):
            for s in range(x.shape[1] - k + 1):
                rows.append(x[b, s : s + k].mean(dim=0))
        out.append(torch.stack(rows))
    return torch.stack(out)


def test_official_training_frame_scores_are_the_own_video_matrix():
    """The reference's key_clip_guided_attention: query j's key clip is its best proposal (cosine) of
    its OWN video, which attends over that video's real frames -> z_j; frame score [i, j] =
    cos(q_i, z_j) (logits: the dot); positives on the diagonal; query 1 (same video as query 0) is a
    negative of query 0."""
    model = build("mssl").eval()  # frame_training: official is the default
    batch = standard_batch()
    with torch.no_grad():
        out = model(batch)
    qc, qf = out.query.vectors["clip"], out.query.vectors["frame"]
    frame = out.scores["frame"]
    nq = batch.num_queries
    assert frame.sim.shape == frame.logits.shape == (nq, nq)
    assert frame.targets.tolist() == list(range(nq))
    assert out.scores["clip"].targets is None and out.scores["clip"].sim.shape == (nq, batch.num_videos)
    lengths = batch.frame_mask.sum(dim=1)
    for j in range(nq):
        v = int(batch.query_video[j])
        props = out.video.clip[v]
        key_clip = props[F.cosine_similarity(qc[j][None], props, dim=-1).argmax()]
        n = int(lengths[v])
        keys, values = out.video.extra["frame_key"][v, :n], out.video.frame[v, :n]
        z = (torch.softmax(keys @ key_clip, dim=0)[:, None] * values).sum(dim=0)
        for i in range(nq):
            assert frame.sim[i, j].item() == pytest.approx(F.cosine_similarity(qf[i], z, dim=0).item(), abs=1e-5)
            assert frame.logits[i, j].item() == pytest.approx((qf[i] @ z).item(), abs=1e-4)


def test_official_diagonal_is_the_all_pairs_score_of_each_querys_own_video():
    model = build("mssl").eval()
    batch = make_batch([5, 3, 7], [4, 2, 3, 5, 1], [0, 0, 1, 2, 2], frame_pad=2)
    with torch.no_grad():
        official = model(batch).scores
        model.frame_training = "all_pairs"
        every_pair = model(batch).scores
    rows = torch.arange(batch.num_queries)
    torch.testing.assert_close(official["frame"].sim.diagonal(), every_pair["frame"].sim[rows, batch.query_video])
    torch.testing.assert_close(official["frame"].logits.diagonal(), every_pair["frame"].logits[rows, batch.query_video])
    torch.testing.assert_close(official["clip"].sim, every_pair["clip"].sim)
    torch.testing.assert_close(official["clip"].logits, every_pair["clip"].logits)
    assert every_pair["frame"].targets is None


def test_official_own_video_scores_without_stored_proposals_are_the_same():
    model = build("mssl").eval()
    batch = standard_batch()
    with torch.no_grad():
        query, video = encoded(model, batch)
        query.own_video = batch.query_video
        stored = model.score(query, video, with_logits=True)
        derived = model.score(query, replace(video, clip=None), with_logits=True)  # key clips from the items
    assert_same_scores(derived, stored)
    torch.testing.assert_close(derived["frame"].targets, stored["frame"].targets)


def test_retrieval_scores_every_pair_whatever_the_training_frame_scores():
    batch = standard_batch()
    got = []
    for frame_training in ("official", "all_pairs"):
        torch.manual_seed(0)
        model = build("mssl", frame_training=frame_training).eval()
        with torch.no_grad():
            query, video = encoded(model, batch, proposals=False)
            got.append(model.score(query, video))
    assert got[0]["frame"].targets is None and got[0]["frame"].sim.shape == (batch.num_queries, batch.num_videos)
    assert_same_scores(got[0], got[1], logits=False)


def test_fusing_training_scores_with_other_columns_is_a_clear_error():
    model = build("mssl").train()
    with pytest.raises(ValueError, match="branch 'frame' holds training scores"):
        model.fuse(model(standard_batch()).scores)


@pytest.mark.parametrize("length, max_window", [(8, 8), (8, 3), (5, 32), (1, 1), (32, 32)])
def test_proposals_are_window_averages(length, max_window):
    x = torch.randn(2, length, 6)
    got = sliding_window_proposals(x, max_window)
    expected = loop_proposals(x, max_window)
    assert got.shape == expected.shape == (2, num_proposals(length, max_window), 6)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_32_clips_give_528_proposals():
    assert num_proposals(32, 32) == 528
    assert sliding_window_proposals(torch.zeros(1, 32, 2), 32).shape == (1, 528, 2)


def test_model_exposes_proposals_and_two_query_vectors():
    model = build("mssl").eval()
    batch = standard_batch()
    with torch.no_grad():
        out = model(batch)
    assert out.video.clip.shape == (4, num_proposals(8, 32), 16)  # 8 clips in the test batch -> 36
    assert out.video.frame.shape == (4, 7, 16) and out.video.frame_mask.shape == (4, 7)
    assert out.video.extra["frame_key"].shape == (4, 7, 16)
    assert out.query.vectors["clip"] is out.query.vectors["frame"]  # one query vector for both, as the reference
    assert model.query.pool.score.weight.shape == (1, 16)  # modular_vector_mapping = Linear(D, 1)
    per_branch = build("mssl", query_pooling="per_branch").eval()
    with torch.no_grad():
        two = per_branch(batch).query.vectors
    assert per_branch.query.pool.score.weight.shape == (2, 16)
    assert not torch.allclose(two["clip"], two["frame"])
    assert build("mssl", max_window=3).eval()(batch).video.clip.shape[1] == num_proposals(8, 3)


def test_scores_match_their_per_pair_definition():
    model = build("mssl", frame_training="all_pairs").eval()
    batch = standard_batch()
    with torch.no_grad():
        out = model(batch)
    qc, qf = out.query.vectors["clip"], out.query.vectors["frame"]
    lengths = batch.frame_mask.sum(dim=1)
    for i in range(batch.num_queries):
        for v in range(batch.num_videos):
            props = out.video.clip[v]
            cos = F.cosine_similarity(qc[i][None], props, dim=-1)
            assert out.scores["clip"].sim[i, v].item() == pytest.approx(cos.max().item(), abs=1e-5)
            assert out.scores["clip"].logits[i, v].item() == pytest.approx((props @ qc[i]).max().item(), abs=1e-4)
            key_clip = props[cos.argmax()]
            n = int(lengths[v])
            keys, values = out.video.extra["frame_key"][v, :n], out.video.frame[v, :n]
            weights = torch.softmax(keys @ key_clip, dim=0)
            z = (weights[:, None] * values).sum(dim=0)
            assert out.scores["frame"].sim[i, v].item() == pytest.approx(
                F.cosine_similarity(qf[i], z, dim=0).item(), abs=1e-5
            )
            assert out.scores["frame"].logits[i, v].item() == pytest.approx((qf[i] @ z).item(), abs=1e-4)


def test_chunked_scoring_equals_one_chunk(monkeypatch):
    model = build("mssl").eval()
    batch = standard_batch()
    with torch.no_grad():
        video = model.encode_videos(batch.clips, batch.frames, batch.frame_mask)
        query = model.encode_queries(batch.queries, batch.query_mask)
        whole = model.score(query, video, with_logits=True)
        monkeypatch.setattr(mssl, "_MAX_CHUNK_ELEMENTS", 1)  # one video per chunk
        chunked = model.score(query, video, with_logits=True)
    for branch in whole:
        torch.testing.assert_close(chunked[branch].sim, whole[branch].sim)
        torch.testing.assert_close(chunked[branch].logits, whole[branch].logits)


@pytest.mark.parametrize("frame_training", ["official", "all_pairs"])
def test_frame_branch_gets_gradients_through_the_key_clip(frame_training):
    model = build("mssl", frame_training=frame_training).train()
    out = model(make_batch([3, 2], [2, 2], [0, 1]))
    out.scores["frame"].sim.sum().backward()
    assert model.clip.layers[0].attention.qkv.weight.grad.abs().sum() > 0  # via the gathered key clip
    assert model.frame_key_value.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("length, max_window", [(8, 8), (8, 3), (5, 32), (1, 1), (32, 32)])
def test_window_matrix_times_items_gives_the_proposals(length, max_window):
    x = torch.randn(2, length, 6)
    window = mssl._window_matrix(length, max_window, x.device)  # (P, L)
    assert window.shape == (num_proposals(length, max_window), length)
    torch.testing.assert_close(window @ x, loop_proposals(x, max_window), atol=1e-5, rtol=1e-5)


def without(video, *keys):
    return replace(video, extra={k: v for k, v in video.extra.items() if k not in keys})


def encoded(model, batch, *, proposals=True):
    """Query and video embeddings; with the proposals stored (as in training) unless ``proposals=False``
    (retrieval without a request for moment tokens)."""
    if proposals:
        with model.training_exposure():
            video = model.encode_videos(batch.clips, batch.frames, batch.frame_mask)
    else:
        video = model.encode_videos(batch.clips, batch.frames, batch.frame_mask)
    return model.encode_queries(batch.queries, batch.query_mask), video


def test_retrieval_keeps_no_proposals_unless_asked_and_scores_the_same():
    model = build("mssl").eval()
    b = make_batch([5, 3, 7, 1], [4, 2, 3, 5, 2], [0, 0, 1, 2, 3], frame_pad=2)
    with torch.no_grad():
        query, stored = encoded(model, b)
        _, derived = encoded(model, b, proposals=False)
        assert derived.clip is None and stored.clip.shape == (4, num_proposals(b.clips.shape[1], 32), 16)
        for with_logits in (True, False):
            assert_same_scores(model.score(query, derived, with_logits=with_logits),
                               model.score(query, stored, with_logits=with_logits), logits=with_logits)
        index = model.index_videos(derived)
        assert index.clip is None and "attended" in index.extra
        assert_same_scores(model.score(query, index), model.score(query, model.index_videos(stored)), logits=False)
        with pytest.raises(ValueError, match="moment"):
            derived.moment_tokens()
        model.request(retrieval=[MOMENT_TOKENS])  # a component that reads moment tokens in retrieval
        _, asked = encoded(model, b, proposals=False)
    torch.testing.assert_close(asked.clip, stored.clip)


def assert_same_scores(got, expected, *, logits=True):
    for branch in ("clip", "frame"):
        torch.testing.assert_close(got[branch].sim, expected[branch].sim, atol=1e-5, rtol=1e-5)
        if logits:
            torch.testing.assert_close(got[branch].logits, expected[branch].logits, atol=1e-5, rtol=1e-5)


def test_proposal_dots_through_the_clip_items_equal_the_dots_with_the_proposals():
    model = build("mssl").eval()
    b = make_batch([5, 3, 7, 1], [4, 2, 3, 5, 2], [0, 0, 1, 2, 3], frame_pad=2)
    with torch.no_grad():
        query, video = encoded(model, b)
        assert video.extra["clip_items"].shape == (4, b.clips.shape[1], 16)
        through_items = model.score(query, video, with_logits=True)
        with_proposals = model.score(query, without(video, "clip_items"), with_logits=True)
        retrieval = model.score(query, video)  # no logits: 1/|p| folded into every video's window
    assert_same_scores(through_items, with_proposals)
    assert_same_scores(retrieval, with_proposals, logits=False)
    assert retrieval["clip"].logits is None and retrieval["frame"].logits is None


def test_training_gradients_through_the_clip_items_equal_those_through_the_proposals():
    torch.manual_seed(0)
    model = build("mssl", dropout=0.0).train()
    b = make_batch([5, 3, 7], [4, 2, 3, 5], [0, 0, 1, 2], frame_pad=1)
    grads = []
    for drop in ((), ("clip_items",)):
        model.zero_grad()
        query, video = encoded(model, b)
        scores = model.score(query, without(video, *drop), with_logits=True)
        sum(s.sim.sum() + s.logits.sum() for s in scores.values()).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-5, rtol=1e-4, msg=name)


def test_indexed_gallery_scores_equal_the_per_pair_attention():
    model = build("mssl").eval()
    b = make_batch([5, 3, 7, 1], [4, 2, 3, 5, 2], [0, 0, 1, 2, 3], frame_pad=2)
    with torch.inference_mode():
        query, video = encoded(model, b)
        index = model.index_videos(video)
        assert model.index_videos(index) is index  # an indexed gallery is returned as it is
        props, nv = video.clip.shape[1], video.clip.shape[0]
        assert index.extra["attended"].shape == (nv, props, 16)
        assert index.extra["attended_norm"].shape == index.extra["proposal_norm"].shape == (nv, props)
        assert "frame_key" not in index.extra and "frame_key" in video.extra  # the input is left as it was
        torch.testing.assert_close(index.extra["attended"].norm(dim=-1), torch.ones(nv, props))
        plain = model.score(query, without(video, "clip_items"), with_logits=True)  # attention per pair
        assert_same_scores(model.score(query, index, with_logits=True), plain)
        assert_same_scores(model.score(query, index), plain, logits=False)
        # a slice of the index (a video chunk) scores as the same slice of the gallery
        part = model.score(query, index.index(slice(1, 3)))
        assert_same_scores(part, model.score(query, without(video, "clip_items").index(slice(1, 3))), logits=False)


def test_index_keeps_the_per_pair_attention_where_memory_is_short(monkeypatch):
    import prvrlab.data.resident as resident

    model = build("mssl").eval()
    b = make_batch([5, 3], [4, 2, 3], [0, 0, 1])
    with torch.inference_mode():
        query, video = encoded(model, b)
        monkeypatch.setattr(resident, "available_bytes", lambda device: 1024)
        index = model.index_videos(video)
        assert "attended" not in index.extra and "frame_key" in index.extra and "proposal_norm" in index.extra
        assert_same_scores(model.score(query, index, with_logits=True), model.score(query, video, with_logits=True))


def test_plugged_mssl_indexes_through_its_backbone():
    from test_ice import plugged

    model = plugged("mssl").eval()
    b = make_batch([5, 3, 4], [4, 2, 3, 5, 2], [0, 0, 1, 2, 2], frame_pad=2)
    with torch.inference_mode():
        query, video = encoded(model, b)
        video.extra["ice.marker"] = torch.arange(3.0)  # a plug-in's per-video entry
        index = model.index_videos(video)
        assert "attended" in index.extra and index.extra["ice.marker"] is video.extra["ice.marker"]
        assert_same_scores(model.score(query, index), model.score(query, video), logits=False)


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"max_window": 0}, "max_window"),
        ({"ffn_size": -1}, "ffn_size"),
        ({"hidden_size": 10, "num_heads": 4}, "num_heads"),
        ({"dropout": 1.0}, "dropout"),
        ({"frame_weight": -1.0}, "frame_weight"),
        ({"frame_training": "diagonal"}, "frame_training"),
    ],
)
def test_rejects_bad_hyperparameters(kwargs, param):
    with pytest.raises(ValueError, match=param):
        build("mssl", **kwargs)
