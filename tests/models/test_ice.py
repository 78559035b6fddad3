"""The ICE / IRM / TCP plug-in (papers/002): pair mining, redundant features, group labels and shuffling."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from prvrlab.models.base import QueryEmbedding, VideoEmbedding
from prvrlab.models.component import EpochContext, StepContext
from prvrlab.models.factory import build_system
from prvrlab.models.plugins.base import PluggedModel, PluginError
from prvrlab.models.plugins.ice import ICE, group_labels, mutual_pairs, shuffle_sources
from prvrlab.registry import PLUGINS
from tests.models.test_backbones import NUM_CLIPS, QUERY_DIM, VIDEO_DIM, build, make_batch
from device_under_test import DEVICE

HIDDEN = 16
# backbone -> plug-in parameters that fit it (MS-SL's moment tokens are proposals: TCP on frames only)
BACKBONE_PARAMS = {
    "ice_base": {},
    "gmmformer": {"moment_branch": "clip", "video_branch": "frame"},
    "gmmformer_v2": {"moment_branch": "clip", "video_branch": "frame"},
    "mssl": {"moment_branch": "clip", "video_branch": "frame", "tcp_levels": "video"},
}
LOSSES_CFG = {
    "ice_corr": {"loss": "ice_corr", "weight": 1.0, "hard_negative_start_epoch": 0},
    "ice_irm": {"loss": "ice_irm", "weight": 1.0},
    "ice_tcp": {"loss": "ice_tcp", "weight": 1.0},
}


def plugged(backbone: str = "ice_base", seed: int = 0, **params) -> PluggedModel:
    torch.manual_seed(seed)
    model = build(backbone, dropout=0.0)
    torch.manual_seed(seed + 1)
    plugin = PLUGINS.build("ice", hidden_size=HIDDEN, **{**BACKBONE_PARAMS[backbone], **params})
    wrapped = PluggedModel(backbone=model, plugins={"ice": plugin})
    wrapped.request(training=plugin.needs(training=True), retrieval=plugin.needs(training=False))
    return wrapped


def batch(**kw):
    return make_batch([5, 3, 4], [4, 2, 3, 5, 2], [0, 0, 1, 2, 2], frame_pad=2, query_pad=1, **kw)


# ---------------------------------------------------------------- contract


def test_registered_and_validates_params():
    assert "ice" in PLUGINS.names()
    for bad, name in (
        ({"threshold": 1.0}, "threshold"),
        ({"threshold": -1.5}, "threshold"),
        ({"groups": 1}, "groups"),
        ({"shuffle_ratio": 1.5}, "shuffle_ratio"),
        ({"tcp_levels": "frames"}, "tcp_levels"),
        ({"ice": "yes"}, "ice"),
        ({"moment_branch": "a b"}, "moment_branch"),
    ):
        with pytest.raises(ValueError, match=name):
            ICE(hidden_size=8, **bad)
    off = ICE(hidden_size=8, ice=False, irm=False, tcp=False)
    assert list(off.parameters()) == [] and off.aux_keys() == () and off.metric_names() == ()
    assert off.needs(training=True) == frozenset() == ICE(hidden_size=8).needs(training=False)


def test_all_parts_off_is_the_bare_backbone():
    b = batch()
    model = plugged(ice=False, irm=False, tcp=False)
    out, bare = model(b), model.backbone(b)
    assert out.aux == {}
    assert all(torch.equal(out.scores[k].sim, bare.scores[k].sim) for k in bare.scores)


def test_check_backbone_names_the_branch_keys():
    plugin = ICE(hidden_size=HIDDEN)
    with pytest.raises(PluginError, match=r"moment_branch: backbone 'gmmformer' has no 'moment' branch \(branches: clip, frame\)"):
        plugin.check_backbone(build("gmmformer"), "gmmformer")
    with pytest.raises(PluginError, match="video_branch"):
        ICE(hidden_size=HIDDEN, moment_branch="clip").check_backbone(build("gmmformer"), "gmmformer")
    ICE(hidden_size=HIDDEN, ice=False, irm=False).check_backbone(build("gmmformer"), "gmmformer")  # TCP: no branch


@pytest.mark.parametrize("backbone", sorted(BACKBONE_PARAMS))
def test_every_backbone_trains_a_step_with_finite_gradients(backbone):
    torch.manual_seed(0)
    plugins = {"ice": {**BACKBONE_PARAMS[backbone], "threshold": -1.0}}  # every mutual pair kept
    system = build_system(
        {"name": backbone, "hidden_size": HIDDEN, "num_heads": 2, "max_frames": 16, "max_query_len": 8},
        plugins,
        LOSSES_CFG,
        video_dim=VIDEO_DIM,
        query_dim=QUERY_DIM,
    )
    result, out = system(batch(), epoch=0)
    assert out.aux["ice.pair_moment"].shape[0] > 0
    assert all(torch.isfinite(v) and v > 0 for v in result.terms.values())
    result.total.backward()
    for name, p in system.named_parameters():
        if name.startswith("model.plugins.ice."):
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    backbone_grads = [p.grad for n, p in system.named_parameters() if n.startswith("model.backbone.") and p.grad is not None]
    assert backbone_grads and all(torch.isfinite(g).all() for g in backbone_grads)


@pytest.mark.parametrize("backbone", sorted(BACKBONE_PARAMS))
def test_retrieval_scores_are_the_bare_backbones(backbone, monkeypatch):
    b = batch()
    model = plugged(backbone)
    model.eval()
    monkeypatch.setattr(ICE, "training_aux", lambda *a: pytest.fail("training-only part ran at retrieval"))
    with torch.no_grad():
        v = model.encode_videos(b.clips, b.frames, b.frame_mask)
        q = model.encode_queries(b.queries, b.query_mask)
        plugged_scores = model.fuse(model.score(q, v))
        bv = model.backbone.encode_videos(b.clips, b.frames, b.frame_mask)
        bq = model.backbone.encode_queries(b.queries, b.query_mask)
        bare = model.backbone.fuse(model.backbone.score(bq, bv))
    assert torch.equal(plugged_scores, bare)
    assert "frame_tokens" not in v.extra  # training-only needs: nothing kept at retrieval


# ---------------------------------------------------------------- ICE


def test_mutual_pairs_on_a_hand_built_matrix():
    # moments m0, m1 of video 0; m2, m3 of video 1; m4, m5 of video 2; text j belongs to video j
    sim = torch.tensor(
        [
            [0.9, 0.5, 0.1],
            [0.2, 0.3, 0.7],
            [0.6, 0.95, 0.2],
            [0.45, 0.1, 0.3],
            [0.1, 0.35, 0.8],
            [0.3, 0.2, 0.5],
        ]
    )
    own = torch.tensor([0, 0, 1, 1, 2, 2])[:, None] == torch.arange(3)[None, :]
    # own entries -> -1; row arg-max: m0->t1, m1->t2, m2->t0, m3->t0, m4->t1, m5->t0;
    # column arg-max: t0->m2 (0.6), t1->m0 (0.5), t2->m1 (0.7): all three mutual
    rows, texts = mutual_pairs(sim, own, 0.4)
    assert rows.tolist() == [2, 0, 1] and texts.tolist() == [0, 1, 2]
    rows, texts = mutual_pairs(sim, own, 0.55)  # t1's 0.5 is below
    assert rows.tolist() == [2, 1] and texts.tolist() == [0, 2]
    rows, texts = mutual_pairs(sim, own, 0.6)  # strictly above: 0.6 itself is dropped
    assert rows.tolist() == [1] and texts.tolist() == [2]
    # m3 now prefers t0 (0.8) and is t2's best (0.75): t0 pairs with m3; t2's best m3 is taken -> no pair
    sim[3] = torch.tensor([0.8, 0.1, 0.75])
    rows, texts = mutual_pairs(sim, own, 0.4)
    assert rows.tolist() == [3, 0] and texts.tolist() == [0, 1]
    # a pair on the video's own moments is never mined, whatever its similarity
    rows, _ = mutual_pairs(torch.full((2, 1), 0.9), torch.ones(2, 1, dtype=torch.bool), -1.0)
    assert rows.numel() == 0


def test_mutual_pairs_match_the_definition_on_random_matrices():
    g = torch.Generator(DEVICE).manual_seed(3)
    for _ in range(20):
        sim = torch.rand(12, 5, generator=g) * 2 - 1
        own = torch.randint(0, 4, (12,), generator=g)[:, None] == torch.randint(0, 4, (5,), generator=g)[None, :]
        s = sim.masked_fill(own, -1.0)
        expected = {
            (i, j)
            for i in range(12)
            for j in range(5)
            if not own[i, j] and s[i, j] > 0.1 and int(s[i].argmax()) == j and int(s[:, j].argmax()) == i
        }
        rows, texts = mutual_pairs(sim, own, 0.1)
        assert set(zip(rows.tolist(), texts.tolist())) == expected


def test_ice_aux_mines_from_moment_tokens_and_skips_padding():
    torch.manual_seed(0)
    plugin = ICE(hidden_size=4, irm=False, tcp=False, threshold=-1.0)
    moments = torch.randn(3, 2, 4, requires_grad=True)  # (Nv, M, D)
    mask = torch.tensor([[True, True], [True, False], [True, True]])
    q = torch.randn(4, 4, requires_grad=True)
    query_video = torch.tensor([0, 1, 1, 2])
    video = VideoEmbedding(extra={"moment_tokens": moments, "moment_mask": mask})
    query = QueryEmbedding(vectors={"moment": q})
    aux = plugin._ice(query, video, query_video)
    cells = [(v, k) for v in range(3) for k in range(2) if mask[v, k]]  # padded moment (1, 1) left out
    s = {
        (c, j): -1.0 if c[0] == int(query_video[j]) else float(F.cosine_similarity(moments[c].detach(), q[j].detach(), dim=0))
        for c in cells
        for j in range(4)
    }
    expected = [
        (c, j)
        for j in range(4)
        for c in cells
        if max(range(4), key=lambda t: s[(c, t)]) == j and max(cells, key=lambda m: s[(m, j)]) == c and s[(c, j)] > -1.0
    ]
    assert expected  # the example mines something
    assert aux["pair_video"].tolist() == [c[0] for c, _ in expected]
    assert aux["pair_text"].tolist() == [j for _, j in expected]
    for n, ((v, k), j) in enumerate(expected):
        assert torch.equal(aux["pair_moment"][n], moments[v, k]) and torch.equal(aux["pair_query"][n], q[j])
    assert aux["pair_moment"].requires_grad  # trained through the embeddings
    assert plugin.pop_step_metrics() == {"mined": float(len(expected))}


def _epoch_ctx() -> EpochContext:
    return EpochContext(
        epoch=0, num_epochs=1, model=None, device=DEVICE, amp_dtype=None, rank=0, world_size=1,
        train_batches=lambda: iter(()),
    )


def test_precision_against_the_ground_truth_and_its_chance_rate():
    plugin = ICE(hidden_size=4, irm=False, tcp=False)
    b = batch()  # videos v0..v2; queries q0, q1 -> v0, q2 -> v1, q3, q4 -> v2
    relevant = torch.tensor(
        [[1, 0, 1], [1, 0, 0], [0, 1, 0], [0, 1, 1], [0, 0, 1]], dtype=torch.bool, device="cpu"
    )  # (Nq, Nv): q0 also fits v2, q3 also fits v1; on the CPU, as GroundTruth.relevant's
    truth = SimpleNamespace(relevant=lambda qids, vids: relevant[[int(q[1:]) for q in qids]][:, [int(v[1:]) for v in vids]])
    aux = {"ice.pair_video": torch.tensor([2, 1, 0]), "ice.pair_text": torch.tensor([0, 3, 4])}  # right, right, wrong
    ctx = StepContext(epoch=0, step=0, global_step=0, batch=b, output=SimpleNamespace(aux=aux), terms={}, truth=truth)
    plugin.on_epoch_start(_epoch_ctx())
    plugin.on_step_end(ctx)
    plugin.on_step_end(ctx)
    out = plugin.on_epoch_end(_epoch_ctx())
    assert out["mined_total"] == 6.0
    assert out["precision"] == pytest.approx(2 / 3)
    assert out["precision_chance"] == pytest.approx(2 / 10)  # 10 unpaired (query, video) pairs, 2 relevant
    no_truth = StepContext(epoch=0, step=0, global_step=0, batch=b, output=SimpleNamespace(aux=aux), terms={})
    plugin.on_step_end(no_truth)
    assert plugin.on_epoch_end(_epoch_ctx()) == {"mined_total": 3.0}  # real data: no precision


# ---------------------------------------------------------------- IRM


@pytest.mark.parametrize("backbone", ["ice_base", "gmmformer_v2"])
def test_irm_features_by_hand(backbone):
    b = batch()
    model = plugged(backbone, ice=False, tcp=False)
    out = model(b)
    plugin = model.plugins["ice"]
    q_name, v_name = plugin.moment_branch, plugin.video_branch
    moments, _ = out.video.moment_tokens()
    for i, v in enumerate(b.query_video.tolist()):
        q = out.query.vectors[q_name][i]
        k = max(range(moments.shape[1]), key=lambda j: float(F.cosine_similarity(moments[v, j], q, dim=0)))
        if out.video.frame.dim() == 2:
            video_vec = out.video.frame[v]
        else:  # per-frame video-level branch: the mean of the real frames
            frames, mask = out.video.frame_tokens()
            video_vec = frames[v][mask[v]].mean(0)
        fc = plugin.redundancy
        assert torch.allclose(out.aux["ice.key_moment"][i], moments[v, k])
        assert torch.allclose(out.aux["ice.redundant_video"][i], fc.weight @ (video_vec - moments[v, k]) + fc.bias, atol=1e-5)
        qv = out.query.vectors[v_name][i]
        assert torch.allclose(out.aux["ice.redundant_query"][i], fc.weight @ (video_vec - qv) + fc.bias, atol=1e-5)
        assert torch.equal(out.aux["ice.query"][i], q)


# ---------------------------------------------------------------- TCP


def test_group_labels_by_hand():
    mask = torch.arange(8)[None, :] < torch.tensor([8, 5, 0, 3])[:, None]
    labels = group_labels(mask, 4)
    assert labels[0].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]  # 8 / 4 = 2 frames per group
    assert labels[1].tolist() == [0, 0, 1, 2, 3, -1, -1, -1]  # floor(r * 4 / 5)
    assert labels[2].tolist() == [-1] * 8
    assert labels[3].tolist() == [0, 1, 2, -1, -1, -1, -1, -1]  # fewer frames than groups: groups skipped


def test_shuffle_is_seeded_reproducible_and_moves_the_exact_fraction():
    lengths = torch.tensor([128, 8, 10, 5, 1, 0])
    mask = torch.arange(128)[None, :] < lengths[:, None]
    draw = lambda seed: shuffle_sources(mask, 0.25, torch.Generator(DEVICE).manual_seed(seed))  # noqa: E731
    src = draw(7)
    assert torch.equal(src, draw(7)) and not torch.equal(src, draw(8))
    identity = torch.arange(128).expand_as(src)
    moved = (src != identity).sum(dim=1)
    # round(0.25 * L): 32, 2, round(2.5) = 3, round(1.25) = 1 -> nothing (one position cannot move), 0, 0
    assert moved.tolist() == [32, 2, 3, 0, 0, 0]
    for row in range(len(lengths)):
        assert sorted(src[row].tolist()) == list(range(128))  # a permutation
        real = mask[row]
        assert real[src[row][real]].all() and torch.equal(src[row][~real], identity[row][~real])  # padding stays
    labels = group_labels(mask, 8)
    shuffled = labels.gather(1, src)
    assert (shuffled != labels).sum() <= moved.sum() and (shuffled[0] != labels[0]).any()


def test_tcp_labels_and_logits_on_the_shuffled_encoding():
    b = batch()
    model = plugged(ice=False, irm=False, groups=2, shuffle_ratio=0.5)
    model.train()
    torch.manual_seed(5)
    out = model(b)
    torch.manual_seed(5)  # the plug-in draws the frame shuffle, then the clip shuffle
    frame_src = shuffle_sources(b.frame_mask, 0.5)
    clip_src = shuffle_sources(torch.ones(3, NUM_CLIPS, dtype=torch.bool), 0.5)
    host, plugin = model.backbone, model.plugins["ice"]
    with host.training_exposure():
        shuffled = host.encode_videos(
            b.clips.gather(1, clip_src[..., None].expand_as(b.clips)),
            b.frames.gather(1, frame_src[..., None].expand_as(b.frames)),
            b.frame_mask,
        )
    y_frames, y_clips = group_labels(b.frame_mask, 2), group_labels(torch.ones(3, NUM_CLIPS, dtype=torch.bool), 2)
    part, labels, logits = out.aux["ice.tcp_part"], out.aux["ice.tcp_labels"], out.aux["ice.tcp_logits"]
    real = b.frame_mask
    assert part.tolist() == sorted(part.tolist()) and torch.bincount(part).tolist() == [real.numel()] * 2 + [3 * NUM_CLIPS] * 2
    assert torch.equal(labels[part == 0], y_frames.flatten()) and torch.equal(labels[part == 1], y_frames.gather(1, frame_src).flatten())
    assert set(labels[part < 2][~real.flatten().repeat(2)].tolist()) == {-1}  # padding: ignored by the loss
    assert torch.equal(labels[part == 2], y_clips.flatten()) and torch.equal(labels[part == 3], y_clips.gather(1, clip_src).flatten())
    slots = real.flatten()
    assert torch.allclose(logits[part == 0][slots], plugin.video_classifier(out.video.frame_tokens()[0][real]), atol=1e-6)
    assert torch.allclose(logits[part == 1][slots], plugin.video_classifier(shuffled.frame_tokens()[0][real]), atol=1e-5)
    assert torch.allclose(logits[part == 3], plugin.moment_classifier(shuffled.moment_tokens()[0].flatten(0, 1)), atol=1e-5)
    metrics = plugin.pop_step_metrics()
    on_shuffled = [bool(logits[i].argmax() == labels[i]) for i in range(len(part)) if part[i] % 2 == 1 and labels[i] >= 0]
    assert set(metrics) == {"tcp_accuracy"}
    assert float(metrics["tcp_accuracy"]) == pytest.approx(sum(on_shuffled) / len(on_shuffled))


def test_tcp_moment_level_needs_one_token_per_clip():
    with pytest.raises(ValueError, match="tcp_levels: video"):
        plugged("mssl", tcp_levels="both")(batch())
    out = plugged("mssl", ice=False, irm=False)(batch())  # video level only
    assert set(out.aux["ice.tcp_part"].tolist()) == {0, 1}


def test_tcp_learns_the_group_labels():
    b = batch()
    torch.manual_seed(0)
    system = build_system(
        {"name": "ice_base", "hidden_size": HIDDEN, "num_heads": 2, "max_frames": 16, "max_query_len": 8, "dropout": 0.0},
        {"ice": {"ice": False, "irm": False}},
        {"ice_tcp": {"loss": "ice_tcp", "weight": 1.0}},
        video_dim=VIDEO_DIM,
        query_dim=QUERY_DIM,
    )
    optimizer = torch.optim.Adam(system.parameters(), lr=1e-2)
    losses = []
    for _ in range(40):
        result, _ = system(b, epoch=0)
        optimizer.zero_grad()
        result.total.backward()
        optimizer.step()
        losses.append(float(result.total))
    assert losses[-1] < 0.5 * losses[0]
