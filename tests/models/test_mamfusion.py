"""MamFusion: GMMFormer + Mamba layers, the batch (reference) and temporal fusions, the switches,
training through the platform and the checkpoint round trip."""

from __future__ import annotations

import math

import pytest
import torch
from test_backbones import build, make_batch, standard_batch, with_padding

from prvrlab.models.mamba import MambaLayer
from prvrlab.models.mamfusion import MultiplicativeCrossAttention
from prvrlab.registry import BACKBONES
from device_under_test import DEVICE


def encode(model, batch):
    return model.encode_queries(batch.queries, batch.query_mask), model.encode_videos(
        batch.clips, batch.frames, batch.frame_mask
    )


def attend_by_hand(m: MultiplicativeCrossAttention, x, memory, mask=None):
    """x (L, D) attends to memory (M, D), head by head and row by row with Python loops."""
    H, Dh = m.num_heads, m.head_dim
    q, kv = m.query(x), m.key_value(memory)
    k, v = kv[:, : H * Dh], kv[:, H * Dh :]
    rows = []
    for i in range(x.shape[0]):
        heads = []
        for h in range(H):
            sl = slice(h * Dh, (h + 1) * Dh)
            logits = [float(q[i, sl] @ k[j, sl]) / math.sqrt(Dh) for j in range(memory.shape[0])]
            keep = [j for j in range(memory.shape[0]) if mask is None or bool(mask[j])]
            top = max(logits[j] for j in keep)
            w = {j: math.exp(logits[j] - top) for j in keep}
            total = sum(w.values())
            heads.append(sum(w[j] / total * v[j, sl] for j in keep))
        rows.append(torch.cat(heads))
    return x * m.out(torch.stack(rows))


def test_registered_with_a_fused_branch_of_weight_zero_by_default():
    model = build("mamfusion")
    assert "mamfusion" in BACKBONES.names()
    assert model.score_weights == {"clip": 0.7, "frame": 0.3, "fused": 0.0}
    at_retrieval = build("mamfusion", fusion="temporal", fusion_at_retrieval=True, fused_weight=0.5)
    assert at_retrieval.score_weights == {"clip": 0.7, "frame": 0.3, "fused": 0.5}


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"fusion": "both"}, "fusion"),
        ({"fusion_at_retrieval": True}, "fusion_at_retrieval"),  # batch fusion cannot score one pair
        ({"fusion": "temporal", "fusion_at_retrieval": True, "fused_weight": 0.0}, "fused_weight"),
        ({"mamba": 1}, "mamba"),
        ({"t2v": "yes"}, "t2v"),
        ({"d_state": 0}, "d_state"),
        ({"mamba_init": "mamba"}, "mamba_init"),
        ({"mamba_residual": "zero"}, "mamba_residual"),
        ({"fusion_chunk": 0}, "fusion_chunk"),
        ({"fusion_init": "xavier"}, "fusion_init"),
        ({"input_dropout": 1.5}, "dropout"),
        ({"dropout": -0.1}, "dropout"),
    ],
)
def test_rejects_bad_hyperparameters(kwargs, key):
    with pytest.raises(ValueError, match=key):
        build("mamfusion", **kwargs)


def test_a_mamba_layer_follows_every_gmm_block_of_both_video_branches():
    model = build("mamfusion", num_gmm_blocks=2)
    assert sum(isinstance(m, MambaLayer) for m in model.clip.modules()) == 2
    assert sum(isinstance(m, MambaLayer) for m in model.frame.modules()) == 2
    assert not any(isinstance(m, MambaLayer) for m in model.query.modules())
    assert not any(isinstance(m, MambaLayer) for m in build("mamfusion", mamba=False).modules())


def test_mamba_init_official_overwrites_the_mixers_and_mamba_ssm_keeps_the_packages_own():
    models = {}
    for init in ("official", "mamba_ssm"):
        torch.manual_seed(0)
        models[init] = build("mamfusion", mamba_init=init)
    official, own = (dict(models[k].named_parameters()) for k in ("official", "mamba_ssm"))
    redrawn = (".in_proj.", ".x_proj.", ".out_proj.", ".dt_proj.")
    mixers = [name for name in official if any(part in name for part in redrawn)]
    layers = sum(isinstance(m, MambaLayer) for m in models["official"].modules())
    assert layers >= 2 and len(mixers) == layers * 5  # in, x, out weights + dt weight and bias
    for name, p in official.items():
        if name in mixers:
            assert not torch.equal(p, own[name]), name
            if name.endswith("dt_proj.bias"):
                assert torch.equal(p, torch.zeros_like(p))  # delta starts at softplus(0)
                assert float(torch.nn.functional.softplus(own[name]).max()) <= 0.1 + 1e-6
            elif name.endswith("in_proj.weight"):
                assert abs(float(p.std()) - 0.02) < 0.002 and float(own[name].std()) > 0.03
        else:  # the rest draws the same numbers in the same order
            torch.testing.assert_close(p, own[name])


def test_fusion_init_official_starts_the_qkv_as_multihead_attention_does():
    """The reference's fusion is an nn.MultiheadAttention: its packed (3D, D) in-projection starts
    xavier-uniform (bound sqrt(6 / 4D)) with zero biases, and the model's N(0, 0.02) re-initialisation
    only reaches its output projection (an nn.Linear)."""
    hidden = 128
    bound = math.sqrt(6.0 / (4 * hidden))
    models = {}
    for init in ("official", "normal"):
        torch.manual_seed(0)
        models[init] = build("mamfusion", hidden_size=hidden, num_heads=4, fusion_init=init)
    for name in ("t2v", "v2t"):
        official, normal = getattr(models["official"], name), getattr(models["normal"], name)
        packed = torch.cat([official.query.weight, official.key_value.weight])  # (3D, D)
        assert packed.shape == (3 * hidden, hidden)
        assert float(packed.abs().max()) <= bound
        assert float(packed.std()) == pytest.approx(bound / math.sqrt(3), rel=0.05)  # uniform(-b, b)
        assert float(torch.cat([official.query.bias, official.key_value.bias]).abs().max()) == 0.0
        assert float(torch.cat([normal.query.weight, normal.key_value.weight]).std()) == pytest.approx(0.02, rel=0.05)
        for model in (official, normal):
            assert float(model.out.weight.std()) == pytest.approx(0.02, rel=0.1)
    assert build("mamfusion", t2v=False, v2t=False).t2v is None  # nothing to start


def test_zero_init_residual_starts_as_the_model_without_mamba():
    torch.manual_seed(0)
    model = build("mamfusion", mamba_residual="zero_init").eval()
    plain = build("mamfusion", mamba=False).eval()
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    assert not missing and all(".mamba." in k for k in unexpected)
    batch = with_padding(standard_batch(), 3, 2)
    with torch.no_grad():
        (_, v), (_, pv) = encode(model, batch), encode(plain, batch)
    torch.testing.assert_close(v.clip, pv.clip, rtol=0, atol=0)
    torch.testing.assert_close(v.frame, pv.frame, rtol=0, atol=0)
    official = build("mamfusion").eval()
    official.load_state_dict(model.state_dict(), strict=False)
    for layer in (m for m in official.modules() if isinstance(m, MambaLayer)):
        torch.nn.init.ones_(layer.norm.weight)
    with torch.no_grad():
        assert not torch.allclose(encode(official, batch)[1].clip, v.clip)


def test_without_mamba_the_clip_and_frame_branches_are_gmmformer():
    torch.manual_seed(0)
    ours = build("mamfusion", mamba=False, dropout=0.0).eval()
    reference = build("gmmformer", dropout=0.0).eval()
    state = {}
    for key, value in reference.state_dict().items():
        for branch in ("clip.layers.", "frame.layers."):
            if key.startswith(branch):
                index, rest = key[len(branch) :].split(".", 1)
                key = f"{branch}{index}.gmm.{rest}"
        state[key] = value
    missing, unexpected = ours.load_state_dict(state, strict=False)
    assert not unexpected and all(k.startswith(("t2v.", "v2t.")) for k in missing)
    batch = standard_batch()
    with torch.no_grad():
        a, b = ours.score(*encode(ours, batch)), reference.score(*encode(reference, batch))
    for branch in ("clip", "frame"):
        torch.testing.assert_close(a[branch].sim, b[branch].sim)


def test_mamba_changes_the_video_branches_but_not_the_query():
    torch.manual_seed(0)
    model = build("mamfusion").eval()
    plain = build("mamfusion", mamba=False).eval()
    plain.load_state_dict(model.state_dict(), strict=False)
    batch = standard_batch()
    with torch.no_grad():
        (q, v), (pq, pv) = encode(model, batch), encode(plain, batch)
    torch.testing.assert_close(q.vectors["clip"], pq.vectors["clip"])
    assert not torch.allclose(v.clip, pv.clip) and not torch.allclose(v.frame, pv.frame)


def test_batch_fusion_matches_a_hand_computation_and_feeds_only_the_fused_branch():
    torch.manual_seed(0)
    model = build("mamfusion", dropout=0.0).eval()
    batch = standard_batch()
    with torch.no_grad():
        out = model(batch)  # the training path (dropout off in eval mode)
        q, v = out.query.vectors["clip"], out.video.frame  # (Nq, D), (Nv, D)
        fused_videos = attend_by_hand(model.t2v, v, q)  # every video attends to the batch's sentences
        expected = attend_by_hand(model.v2t, q, fused_videos)
        torch.testing.assert_close(out.query.vectors["fused"], expected, rtol=1e-5, atol=1e-6)
        cos = torch.nn.functional.cosine_similarity(expected[:, None], v[None], dim=-1)
        torch.testing.assert_close(out.scores["fused"].sim, cos, rtol=1e-5, atol=1e-6)
        # retrieval: no batch, so no fused vector; the fused branch then scores the unfused query
        retrieval = model.score(*encode(model, batch))
        torch.testing.assert_close(retrieval["fused"].sim, retrieval["frame"].sim)
        assert "fused" not in encode(model, batch)[0].vectors


@pytest.mark.parametrize("t2v, v2t", [(False, True), (True, False), (False, False)])
def test_batch_fusion_switches(t2v, v2t):
    torch.manual_seed(0)
    model = build("mamfusion", t2v=t2v, v2t=v2t, dropout=0.0).eval()
    assert (model.t2v is not None, model.v2t is not None) == (t2v, v2t)
    with torch.no_grad():
        out = model(standard_batch())
        q, v = out.query.vectors["clip"], out.video.frame
        expected = q if not v2t else attend_by_hand(model.v2t, q, v)  # without t2v: the unfused videos
    torch.testing.assert_close(out.query.vectors["fused"], expected, rtol=1e-5, atol=1e-6)


def temporal(**kwargs):
    torch.manual_seed(0)
    return build("mamfusion", fusion="temporal", dropout=0.0, **kwargs).eval()


def test_temporal_pair_fusion_matches_a_hand_computation():
    model = temporal(fusion_at_retrieval=True)
    batch = standard_batch()
    with torch.no_grad():
        query, video = encode(model, batch)
        scores = model.score(query, video)["fused"].sim  # (Nq, Nv)
        words, word_mask = query.word_tokens()
        frames, frame_mask = video.frame_tokens()
        for i in (0, 3, 6):
            for j in range(batch.num_videos):
                w, f = words[i][word_mask[i]], frames[j][frame_mask[j]]  # real tokens only
                fused_frames = attend_by_hand(model.t2v, f, w)
                fused_words = attend_by_hand(model.v2t, w, fused_frames)
                q = model.query.pool(fused_words[None])[0]
                v = model.frame.pool(fused_frames[None])[0]
                expected = torch.nn.functional.cosine_similarity(q, v, dim=0)
                assert float(scores[i, j]) == pytest.approx(float(expected), abs=1e-5)


def test_temporal_fusion_at_retrieval_is_chunked_padding_free_and_consistent():
    model = temporal(fusion_at_retrieval=True)
    tiny_chunks = temporal(fusion_at_retrieval=True, fusion_chunk=1)  # one pair at a time
    tiny_chunks.load_state_dict(model.state_dict())
    batch = standard_batch()
    with torch.no_grad():
        full = model.score(*encode(model, batch), with_logits=True)["fused"]
        chunked = tiny_chunks.score(*encode(tiny_chunks, batch), with_logits=True)["fused"]
        padded = model.score(*encode(model, with_padding(batch, frame_pad=5, query_pad=2)))["fused"]
    torch.testing.assert_close(chunked.sim, full.sim)
    torch.testing.assert_close(chunked.logits, full.logits)
    torch.testing.assert_close(padded.sim, full.sim, rtol=1e-5, atol=1e-5)
    fused = model.fuse(model.score(*encode(model, batch)))
    with torch.no_grad():
        s = model.score(*encode(model, batch))
    torch.testing.assert_close(fused, 0.7 * s["clip"].sim + 0.3 * s["frame"].sim + 0.3 * s["fused"].sim)


def test_temporal_training_vector_is_each_query_fused_with_its_own_video():
    model = temporal()
    batch = standard_batch()
    with torch.no_grad():
        out = model(batch)
        pair_q, _ = model._pair_fusion(out.query, out.video)  # (Nq, Nv, D)
    own = batch.query_video
    torch.testing.assert_close(out.query.vectors["fused"], pair_q[torch.arange(len(own)), own], rtol=1e-5, atol=1e-6)
    # fusion only shapes training: without fusion_at_retrieval, retrieval's fused branch is the unfused one
    with torch.no_grad():
        retrieval = model.score(*encode(model, batch))
    torch.testing.assert_close(retrieval["fused"].sim, retrieval["frame"].sim)


def test_temporal_fusion_trains_its_parameters():
    model = build("mamfusion", fusion="temporal").train()
    out = model(make_batch([4, 2, 3], [3, 2, 4, 1], [0, 0, 1, 2]))
    (out.scores["fused"].logits.sum() + out.query.vectors["fused"].sum()).backward()
    for name in ("t2v.query.weight", "v2t.key_value.weight", "v2t.out.weight"):
        grad = dict(model.named_parameters())[name].grad
        assert grad is not None and grad.abs().sum() > 0, name


@pytest.mark.slow
def test_trains_through_the_platform_and_the_checkpoint_round_trips(tiny_root, tmp_path):
    pytest.importorskip("mlflow")  # the run is recorded in MLflow (absent from the GPU image)
    from prvrlab.data.collection import open_collection
    from prvrlab.evaluation.retrieval import evaluate
    from prvrlab.models.factory import build_model
    from prvrlab.platform.config import load_raw, validate
    from prvrlab.platform.train.driver import train
    from prvrlab.platform.train.loop import seed_everything

    raw = load_raw("configs/mamfusion_synth.yaml")
    raw["data"] = {"root": str(tiny_root), "collection": "synth", "visual_feature": "synth_feat"}
    raw["model"].update(hidden_size=32, num_heads=2, dropout=0.0, num_gmm_blocks=1)
    raw["train"] = {"epochs": 4, "batch_size": 16, "lr": 1e-3, "num_workers": 1, "seed": 0}
    raw["eval"] = {"final_splits": ["val"]}
    raw["tracking"] = {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": "tests", "storage_path": str(tmp_path / "r")}
    cfg = validate(raw)
    seed_everything(0)
    collection = open_collection(cfg.data)
    dims = {"video_dim": collection.video_dim, "query_dim": collection.query_dim}
    before = evaluate(build_model(cfg.model, cfg.plugins, **dims), collection, "val", cfg.eval, device=DEVICE)
    result = train(cfg, use_ray=False, echo=None)
    losses = [h["train/loss"] for h in result.history]
    assert losses[-1] < losses[0], losses
    assert "train/query_diverse" in result.history[0]
    assert result.best_sumr > before.metrics["sumr"] + 10, (before.metrics["sumr"], result.best_sumr)
    saved = torch.load(result.run_dir / "best_model.pt", map_location="cpu", weights_only=True)
    model = build_model(cfg.model, cfg.plugins, **dims)
    model.load_state_dict(saved["model"])
    after = evaluate(model, collection, "val", cfg.eval, device=DEVICE)
    assert after.metrics["sumr"] == pytest.approx(result.best_sumr)


def test_temporal_scoring_of_an_empty_gallery_or_query_set():
    model = temporal(fusion_at_retrieval=True)
    with torch.no_grad():
        query, video = encode(model, standard_batch())
        assert model.score(query, video.index(slice(0, 0)))["fused"].sim.shape == (7, 0)
        assert model.score(query.index(slice(0, 0)), video)["fused"].sim.shape == (0, 4)


def test_a_plugged_model_adds_the_backbones_batch_vectors():
    """The batch_vectors hook is called by PluggedModel.forward too (here with the RAL plug-in)."""
    from prvrlab.models.plugins.base import PluggedModel
    from prvrlab.registry import PLUGINS

    torch.manual_seed(0)
    backbone = build("mamfusion", dropout=0.0).eval()
    plugin = PLUGINS.build("ral", hidden_size=16)
    wrapped = PluggedModel(backbone=backbone, plugins={"ral": plugin}).eval()
    wrapped.request(training=plugin.needs(training=True), retrieval=plugin.needs(training=False))
    batch = standard_batch()
    with torch.no_grad():
        torch.testing.assert_close(wrapped(batch).query.vectors["fused"], backbone(batch).query.vectors["fused"])


def test_fusion_combine_replace_is_the_attention_output_the_multiply_switch_scales():
    """``replace`` (the paper's Eqs. 3-4) returns A with x * A the reference's product, which
    attend_by_hand computes row by row; A has the broadcast (pair) shape of the product."""
    torch.manual_seed(0)
    product = MultiplicativeCrossAttention(hidden_size=8, num_heads=2)
    replace = MultiplicativeCrossAttention(hidden_size=8, num_heads=2, multiply=False)
    replace.load_state_dict(product.state_dict())
    x, memory, mask = torch.randn(5, 8), torch.randn(4, 8), torch.tensor([True, True, False, True])
    with torch.no_grad():
        attended = replace(x, memory, mask)
        torch.testing.assert_close(x * attended, attend_by_hand(product, x, memory, mask), rtol=1e-5, atol=1e-6)
        assert not torch.allclose(attended, product(x, memory, mask))
        pairs = replace(torch.randn(1, 3, 5, 8), torch.randn(2, 1, 4, 8))  # every (query, video) pair
    assert pairs.shape == (2, 3, 5, 8)


def test_batch_fusion_with_fusion_combine_replace_chains_the_bare_attentions():
    torch.manual_seed(0)
    model = build("mamfusion", dropout=0.0, fusion_combine="replace").eval()
    assert not model.t2v.multiply and not model.v2t.multiply and build("mamfusion").t2v.multiply
    with torch.no_grad():
        out = model(standard_batch())
        q, v = out.query.vectors["clip"], out.video.frame  # (Nq, D), (Nv, D)
        fused_videos = model.t2v(v, q)  # (Nv, D)
        torch.testing.assert_close(fused_videos * v, attend_by_hand(model.t2v, v, q), rtol=1e-5, atol=1e-6)
        expected = model.v2t(q, fused_videos)  # (Nq, D)
        torch.testing.assert_close(expected * q, attend_by_hand(model.v2t, q, fused_videos), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.query.vectors["fused"], expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="fusion_combine"):
        build("mamfusion", fusion_combine="add")


def test_mamba_residual_paper_is_the_bare_mixer_after_every_gmm_block():
    """Eq. 5, V_fm = Mamba(V_fg): no LayerNorm and no residual around the mixer."""
    torch.manual_seed(0)
    model = build("mamfusion", mamba_residual="paper").eval()
    layers = [m for m in model.modules() if isinstance(m, MambaLayer)]
    assert len(layers) >= 2 and all(layer.norm is None for layer in layers)  # clip and frame branches
    official = build("mamfusion").eval()
    missing, unexpected = official.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and missing and all(".mamba.norm." in k for k in missing)
    block = model.clip.layers[0]
    x = torch.randn(2, 6, model.hidden_size)
    with torch.no_grad():
        gmm = block.gmm(x)  # (B, L, D)
        torch.testing.assert_close(block(x), block.mamba.mamba(gmm), rtol=1e-5, atol=1e-6)
