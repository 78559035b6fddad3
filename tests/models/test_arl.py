"""ARL: the `arl` backbone, and the `arl` plug-in's uncertainty (Eq. 4), detection (Eqs. 5-7) and
cross-model encoders (Eq. 13)."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from prvrlab.data.batch import Batch
from prvrlab.models.component import EpochContext
from prvrlab.models.factory import build_model, build_system
from prvrlab.models.plugins.arl import (
    ARL,
    UncertaintyTables,
    best_frame,
    detect_ambiguity,
    frame_similarity,
    naive_uncertainty,
)
from prvrlab.models.plugins.base import PluginError
from prvrlab.registry import PLUGINS

from test_backbones import QUERY_DIM, VIDEO_DIM, make_batch
from device_under_test import DEVICE

TINY_ARL = {"name": "arl", "hidden_size": 16, "num_heads": 2, "max_frames": 16, "max_query_len": 8, "dropout": 0.0}


def renamed(batch: Batch, tag: str) -> Batch:
    return replace(batch, video_ids=[f"{tag}{v}" for v in batch.video_ids], query_ids=[f"{tag}{q}" for q in batch.query_ids])


def split_batches() -> list[Batch]:
    """Three batches of a 'training split' with different frame lengths and query counts."""
    return [
        renamed(make_batch([7, 3, 1, 5], [4, 2, 6, 1, 3, 5, 2], [0, 0, 1, 2, 2, 2, 3], seed=1), "a"),
        renamed(make_batch([9, 2], [3, 3, 4], [0, 1, 1], seed=2), "b"),
        renamed(make_batch([4, 6, 6], [2, 5, 1, 2], [0, 1, 2, 2], seed=3), "c"),
    ]


def context(model, batches, epoch: int = 5) -> EpochContext:
    return EpochContext(
        epoch=epoch,
        num_epochs=10,
        model=model,
        device=DEVICE,
        amp_dtype=None,
        rank=0,
        world_size=1,
        train_batches=lambda: iter(batches),
    )


def arl_model(backbone: dict | None = None, **plugin):
    torch.manual_seed(0)
    return build_model(backbone or TINY_ARL, {"arl": {"warmup_epochs": 0, **plugin}}, video_dim=VIDEO_DIM, query_dim=QUERY_DIM)


def encode_all(model, batches, encoder: int):
    """Every batch encoded by encoder 0 (theta) or 1 (Phi): queries (Nq, D), frames (Nv, L, D), mask."""
    plugin = model.plugins["arl"]
    qs, fs, ms = [], [], []
    for batch in batches:
        video, query = context(model, batches).encode(batch)
        q, f, m = plugin.encoder_views(query, video)[encoder]
        qs.append(q)
        fs.append(f)
        ms.append(m)
    length = max(f.shape[1] for f in fs)
    frames = torch.cat([F.pad(f, (0, 0, 0, length - f.shape[1])) for f in fs])
    mask = torch.cat([F.pad(m, (0, length - m.shape[1])) for m in ms])
    return torch.cat(qs), frames, mask


def in_batch_pairs(model, batches, encoder: int, naive_q, naive_v):
    """(s, u, positive) of every in-batch text-video pair, each batch by a hand loop over its pairs."""
    plugin = model.plugins["arl"]
    q_start = v_start = 0
    out = []
    for batch in batches:
        video, query = context(model, batches).encode(batch)
        q, frames, mask = plugin.encoder_views(query, video)[encoder]
        for i in range(q.shape[0]):
            for j in range(frames.shape[0]):
                cos = [float(F.cosine_similarity(q[i], frames[j, k], dim=0)) for k in range(frames.shape[1]) if mask[j, k]]
                k_hat = max(range(len(cos)), key=cos.__getitem__)  # real frames come first
                u = 0.5 * (float(naive_q[q_start + i]) + float(naive_v[v_start + j, k_hat]))
                out.append((cos[k_hat], u, int(batch.query_video[i]) == j))
        q_start, v_start = q_start + q.shape[0], v_start + frames.shape[0]
    return out


def rule_tau_u_by_hand(model, batches, encoder: int, naive_q, naive_v) -> float:
    """Mean of u (Eq. 5) over the split's text-video pairs: per query 1 positive, N_v - 1 unpaired."""
    pairs = in_batch_pairs(model, batches, encoder, naive_q, naive_v)
    positive = [u for _, u, p in pairs if p]
    unpaired = [u for _, u, p in pairs if not p]
    num_videos = sum(b.num_videos for b in batches)
    return sum(positive) / len(positive) / num_videos + sum(unpaired) / len(unpaired) * (1 - 1 / num_videos)


# ------------------------------------------------------------------ Eq. 4


@pytest.mark.parametrize("cross_model", [False, True])
def test_fast_uncertainty_equals_the_naive_map(cross_model):
    model = arl_model(cross_model=cross_model)
    batches = split_batches()
    tables = model.plugins["arl"].dataset_uncertainty(context(model, batches))
    assert len(tables) == (2 if cross_model else 1)
    query_ids = [q for b in batches for q in b.query_ids]
    video_ids = [v for b in batches for v in b.video_ids]
    query_video = torch.cat([b.query_video + sum(x.num_videos for x in batches[:k]) for k, b in enumerate(batches)])
    for encoder, table in enumerate(tables):
        queries, frames, mask = encode_all(model, batches, encoder)
        naive_q, naive_v = naive_uncertainty(queries, frames, mask)  # through the (Nq, Nv, L) map M
        got_q, got_v = table.lookup(query_ids, video_ids, frames.shape[1])
        torch.testing.assert_close(got_q.double(), naive_q, atol=1e-5, rtol=0)
        torch.testing.assert_close(got_v.double(), naive_v, atol=1e-5, rtol=0)
        # the rule: tau_s = mean s of the positive pairs; tau_u: rule_tau_u_by_hand
        assert table.tau_u == pytest.approx(rule_tau_u_by_hand(model, batches, encoder, naive_q, naive_v), abs=1e-6)
        s, _ = best_frame(frame_similarity(queries, frames), mask)
        assert table.tau_s == pytest.approx(float(s[torch.arange(len(query_ids)), query_video].mean()), abs=1e-6)
    if cross_model:  # two encoders, two different tables
        assert not torch.allclose(tables[0].query, tables[1].query)


def test_repeated_videos_of_the_padded_share_count_once():
    model = arl_model(cross_model=False)
    batches = split_batches()
    plugin = model.plugins["arl"]
    once = plugin.dataset_uncertainty(context(model, batches))[0]
    twice = plugin.dataset_uncertainty(context(model, batches + [batches[1]]))[0]  # the sampler's wrap-around
    torch.testing.assert_close(once.query, twice.query)
    torch.testing.assert_close(once.frame, twice.frame)
    assert (once.tau_s, once.tau_u) == pytest.approx((twice.tau_s, twice.tau_u))


def test_logs_the_fig4_distributions_of_positive_and_unpaired_pairs():
    model = arl_model(cross_model=True)
    batches = split_batches()
    plugin = model.plugins["arl"]
    plugin.dataset_uncertainty(context(model, batches))
    logged = plugin.pop_distributions()
    assert set(logged) == {"similarity", "uncertainty"}  # of theta (encoder 0) only
    queries, frames, mask = encode_all(model, batches, 0)
    naive_q, naive_v = naive_uncertainty(queries, frames, mask)
    pairs = in_batch_pairs(model, batches, 0, naive_q, naive_v)
    for name, column in (("similarity", 0), ("uncertainty", 1)):
        series, low, high, bins = logged[name]
        assert (low, high) == (-1.0, 1.0) and set(series) == {"positive", "unpaired"}
        for key, is_positive in (("positive", True), ("unpaired", False)):
            expected = sorted(pair[column] for pair in pairs if pair[2] == is_positive)
            assert len(expected) == (7 + 3 + 4 if is_positive else 7 * 3 + 3 * 1 + 4 * 2)
            assert sorted(series[key].tolist()) == pytest.approx(expected, abs=1e-5)


def test_fixed_thresholds_replace_the_rule():
    model = arl_model(cross_model=False, tau_s_mode="fixed", tau_s=0.3, tau_u_mode="fixed", tau_u=-0.2)
    table = model.plugins["arl"].dataset_uncertainty(context(model, split_batches()))[0]
    assert (table.tau_s, table.tau_u) == (0.3, -0.2)


# ------------------------------------------------------------------ Eqs. 5-7


def test_detection_on_a_hand_computed_example():
    # 2 queries x 2 videos x 3 frames; video 1 has 2 real frames
    sf = torch.tensor(
        [
            [[0.9, 0.2, 0.6], [0.5, 0.7, 0.95]],
            [[0.1, 0.65, 0.3], [0.8, 0.2, -0.3]],
        ]
    )
    mask = torch.tensor([[True, True, True], [True, True, False]])
    uq = torch.tensor([0.4, 0.0])
    uv = torch.tensor([[0.0, 0.4, 0.2], [0.2, 0.6, 0.9]])
    video, frame = detect_ambiguity(sf, mask, uq, uv, tau_s=0.6, tau_u=0.25)
    # s: q0 -> v0 0.9 at k0 (u = (0.4 + 0.0)/2 = 0.2), v1 0.7 at k1 (the padded 0.95 never wins; u = 0.5)
    #    q1 -> v0 0.65 at k1 (u = 0.2), v1 0.8 at k0 (u = 0.1)
    assert video.tolist() == [[False, True], [False, False]]
    # text-frame: s^f > 0.6 and (U^q + U^v) / 2 > 0.25, real frames only
    # q0: v0k0 u .2 no; v0k2 0.6 not > 0.6; v1k1 0.7 u .5 yes; v1k2 padded no
    # q1: v0k1 0.65 u .2 no; v1k0 0.8 u .1 no
    assert frame.tolist() == [[[False, False, False], [False, True, False]], [[False] * 3, [False] * 3]]


def set_tables(model, batch: Batch, **thresholds) -> None:
    """Epoch-start tables computed on ``batch`` alone (the 'training split')."""
    model.plugins["arl"].on_epoch_start(context(model, [batch]))
    for table in model.plugins["arl"].__dict__["_tables"]:
        table.tau_s = thresholds.get("tau_s", table.tau_s)
        table.tau_u = thresholds.get("tau_u", table.tau_u)


def test_cross_model_trains_each_encoder_with_the_others_sets():
    model = arl_model(cross_model=True).train()
    batch = split_batches()[0]
    set_tables(model, batch, tau_s=-1.0)  # every pair above tau_s: the sets follow the uncertainty
    out = model(batch)
    plugin = model.plugins["arl"]
    tables = plugin.__dict__["_tables"]
    own = []
    for m in (0, 1):
        sim = out.aux[f"arl.frame_sim{m}"].detach()
        uq, uv = tables[m].lookup(batch.query_ids, batch.video_ids, sim.shape[2])
        own.append(detect_ambiguity(sim, out.aux["arl.frame_mask"], uq, uv, tables[m].tau_s, tables[m].tau_u))
    assert not torch.equal(own[0][0], own[1][0])  # the encoders disagree, so the swap is visible
    assert torch.equal(out.aux["arl.video_sets0"], own[1][0]) and torch.equal(out.aux["arl.frame_sets0"], own[1][1])
    assert torch.equal(out.aux["arl.video_sets1"], own[0][0]) and torch.equal(out.aux["arl.frame_sets1"], own[0][1])

    single = arl_model(cross_model=False).train()
    set_tables(single, batch, tau_s=-1.0)
    out = single(batch)
    table = single.plugins["arl"].__dict__["_tables"][0]
    uq, uv = table.lookup(batch.query_ids, batch.video_ids, batch.frames.shape[1])
    sets = detect_ambiguity(out.aux["arl.frame_sim0"].detach(), out.aux["arl.frame_mask"], uq, uv, table.tau_s, table.tau_u)
    assert torch.equal(out.aux["arl.video_sets0"], sets[0]) and sets[0].any()


def test_level_switches_and_warmup_empty_the_sets():
    batch = split_batches()[0]
    for switches, video_on, frame_on in [({}, True, True), ({"text_video": False}, False, True), ({"text_frame": False}, True, False)]:
        model = arl_model(cross_model=False, **switches).train()
        set_tables(model, batch, tau_s=-1.0, tau_u=-1.0)
        out = model(batch)
        assert bool(out.aux["arl.video_sets0"].any()) is video_on
        assert bool(out.aux["arl.frame_sets0"].any()) is frame_on
        assert bool(out.aux["arl.frame_on"]) is frame_on

    model = arl_model(cross_model=False, warmup_epochs=3)
    plugin = model.plugins["arl"]
    assert plugin.on_epoch_start(context(model, [batch], epoch=2)) == {}  # warm-up: no pass, nothing detected
    out = model.train()(batch)
    assert not out.aux["arl.video_sets0"].any() and not bool(out.aux["arl.frame_on"])
    metrics = plugin.on_epoch_start(context(model, [batch], epoch=3))  # exactly at E_w
    assert set(metrics) == {"tau_s", "tau_u"} and bool(model.train()(batch).aux["arl.frame_on"])


def test_step_metrics_count_unpaired_ambiguous_pairs():
    model = arl_model(cross_model=False).train()
    batch = split_batches()[0]
    set_tables(model, batch, tau_s=-1.0, tau_u=-1.0)  # everything is ambiguous
    model(batch)
    metrics = model.plugins["arl"].pop_step_metrics()
    nq, nv = batch.num_queries, batch.num_videos
    assert metrics["ambiguous_tv"] == nq * nv - nq  # every unpaired pair
    own_frames = batch.frame_mask[batch.query_video].sum()
    assert metrics["ambiguous_tf"] == float(own_frames - nq)  # every frame of the own video but k_hat


# ------------------------------------------------------------------ Eq. 13, checkpoints


def test_cross_model_retrieval_averages_the_encoders_and_survives_a_checkpoint():
    model = arl_model(cross_model=True).eval()
    batch = split_batches()[0]
    peer = model.plugins["arl"].peer
    assert type(peer) is type(model.backbone) and peer is not model.backbone
    with torch.no_grad():
        video = model.encode_videos(batch.clips, batch.frames, batch.frame_mask)
        query = model.encode_queries(batch.queries, batch.query_mask)
        fused = model.fuse(model.score(query, video))
        own = model.backbone.score(query, video)["frame"].sim
        other = peer.score(peer.encode_queries(batch.queries, batch.query_mask),
                           peer.encode_videos(batch.clips, batch.frames, batch.frame_mask))["frame"].sim
    torch.testing.assert_close(fused, 0.5 * (own + other))
    assert not torch.allclose(own, other)
    torch.manual_seed(1)
    reloaded = build_model(TINY_ARL, {"arl": {"cross_model": True}}, video_dim=VIDEO_DIM, query_dim=QUERY_DIM).eval()
    reloaded.load_state_dict(copy.deepcopy(model.state_dict()))
    assert any(k.startswith("plugins.arl.peer.") for k in model.state_dict())
    with torch.no_grad():
        again = reloaded.fuse(reloaded.score(reloaded.encode_queries(batch.queries, batch.query_mask),
                                             reloaded.encode_videos(batch.clips, batch.frames, batch.frame_mask)))
    torch.testing.assert_close(again, fused)


def test_cross_model_retrieval_indexes_the_second_encoders_gallery():
    model = arl_model({"name": "mssl", "hidden_size": 16, "num_heads": 2, "dropout": 0.0}, cross_model=True).eval()
    batch = split_batches()[0]
    with torch.inference_mode():
        video = model.encode_videos(batch.clips, batch.frames, batch.frame_mask)
        query = model.encode_queries(batch.queries, batch.query_mask)
        index = model.index_videos(video)
        assert "attended" in index.extra and "attended" in index.extra["arl.video"].extra  # both encoders'
        assert "attended" not in video.extra["arl.video"].extra  # the input is left as it was
        assert model.index_videos(index) is index
        indexed, plain = model.score(query, index), model.score(query, video)
    for name in plain:
        torch.testing.assert_close(indexed[name].sim, plain[name].sim, atol=1e-5, rtol=1e-5)


def test_cross_model_mean_keeps_official_mssls_own_video_frame_matrix():
    """Eq. 13 on MS-SL's official training frame branch: both encoders score the same (query, own-video
    vector) pairs, so the mean keeps the (Nq, Nq) columns and their targets."""
    model = arl_model({"name": "mssl", "hidden_size": 16, "num_heads": 2, "dropout": 0.0}, cross_model=True).eval()
    batch = split_batches()[0]
    nq = batch.num_queries
    with torch.no_grad():
        out = model(batch)
        own = model.backbone.score(out.query, out.video, with_logits=True)["frame"]
        peer_query = replace(out.query.extra["arl.query"], own_video=batch.query_video)
        peer = model.plugins["arl"].peer.score(peer_query, out.video.extra["arl.video"], with_logits=True)["frame"]
    frame = out.scores["frame"]
    assert frame.sim.shape == own.sim.shape == peer.sim.shape == (nq, nq)
    assert frame.targets.tolist() == list(range(nq))
    torch.testing.assert_close(frame.sim, 0.5 * (own.sim + peer.sim))
    torch.testing.assert_close(frame.logits, 0.5 * (own.logits + peer.logits))


def test_the_arl_backbone_scores_by_the_best_real_frame():
    model = arl_model(cross_model=False).eval()
    batch = split_batches()[0]
    with torch.no_grad():
        video = model.backbone.encode_videos(batch.clips, batch.frames, batch.frame_mask)
        query = model.backbone.encode_queries(batch.queries, batch.query_mask)
        sim = model.backbone.score(query, video)["frame"].sim
    for i in range(batch.num_queries):
        for j in range(batch.num_videos):
            real = video.frame[j][batch.frame_mask[j]]  # (L_j, D)
            expected = max(float(F.cosine_similarity(query.vectors["frame"][i], f, dim=0)) for f in real)
            assert float(sim[i, j]) == pytest.approx(expected, abs=1e-5)


# ------------------------------------------------------------------ any frame backbone, by configuration

BACKBONE_LOSSES = {
    "arl": {},
    "gmmformer": {"clip_triplet": {"loss": "triplet", "branch": "clip"}, "frame_triplet": {"loss": "triplet", "branch": "frame"}},
    "gmmformer_v2": {"clip_triplet": {"loss": "triplet", "branch": "clip"}},
    "mssl": {"clip_triplet": {"loss": "triplet", "branch": "clip"}, "frame_triplet": {"loss": "triplet", "branch": "frame"},
             "frame_nce": {"loss": "infonce", "branch": "frame", "form": "joint"}},
}


@pytest.mark.parametrize("cross_model", [False, True])
@pytest.mark.parametrize("name", list(BACKBONE_LOSSES))
def test_every_frame_backbone_trains_a_step_with_finite_gradients(name, cross_model):
    backbone = {"name": name, "hidden_size": 16, "num_heads": 2, "dropout": 0.0}
    if name == "gmmformer":
        backbone["num_gmm_blocks"] = 1
    losses = {**BACKBONE_LOSSES[name], "ambiguity": {"loss": "arl", "weight": 1.0}}
    torch.manual_seed(0)
    system = build_system(backbone, {"arl": {"cross_model": cross_model, "warmup_epochs": 0}}, losses,
                          video_dim=VIDEO_DIM, query_dim=QUERY_DIM)
    batch = split_batches()[0]
    metrics = system.model.plugins["arl"].on_epoch_start(context(system.model, [batch]))
    assert set(metrics) >= {"tau_s", "tau_u"}
    system.train()
    result, out = system(batch, epoch=0)
    assert bool(out.aux["arl.frame_on"])
    result.total.backward()
    for pname, param in system.named_parameters():
        if param.requires_grad:
            assert param.grad is not None, pname
            assert torch.isfinite(param.grad).all(), pname


def test_plugin_rejects_a_backbone_without_the_branch_and_bad_values():
    plugin = PLUGINS.build("arl", hidden_size=16)
    with pytest.raises(PluginError, match=r"backbone 'ice_base' has no 'frame' branch.*plugins\.arl\.branch"):
        plugin.check_backbone(type("B", (), {"score_weights": {"moment": 0.5, "video": 0.5}})(), "ice_base")
    for kwargs, name in [({"tau_s": 1.5}, "tau_s"), ({"tau_u": "x"}, "tau_u"), ({"warmup_epochs": -1}, "warmup_epochs"),
                         ({"tau_s_mode": "median"}, "tau_s_mode"), ({"cross_model": 1}, "cross_model")]:
        with pytest.raises(ValueError, match=name):
            PLUGINS.build("arl", hidden_size=16, **kwargs)
    assert isinstance(plugin, ARL) and plugin.switch_params == ("text_video", "text_frame", "cross_model")


def test_unknown_ids_are_a_clear_error():
    table = UncertaintyTables({"q0": 0}, torch.zeros(1), {"v0": 0}, torch.zeros(1, 2), 0.0, 0.0)
    with pytest.raises(PluginError, match="'q9' is not in the training split"):
        table.lookup(["q9"], ["v0"], 2)
