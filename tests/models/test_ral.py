"""The RAL plug-in (MSRA + CSA) and the generic plug-in wrapper."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from prvrlab.models.base import VideoEmbedding
from prvrlab.models.component import FRAME_TOKENS, WORD_TOKENS
from prvrlab.models.plugins.base import PluggedModel, PluginError
from prvrlab.models.plugins.ral import RAL, confidence_scores, gated_attention, masked_softmax, sample_proxies
from prvrlab.registry import BACKBONES, PLUGINS
from tests.models.test_backbones import build, make_batch
from device_under_test import DEVICE

FRAME_BACKBONES = [n for n in ("gmmformer", "gmmformer_v2", "mssl") if n in BACKBONES.names()]
HIDDEN = 16


def plugged(backbone: str = "gmmformer", seed: int = 0, **params) -> PluggedModel:
    torch.manual_seed(seed)
    model = build(backbone, dropout=0.0) if "dropout" in BACKBONES.params(backbone) else build(backbone)
    torch.manual_seed(seed + 1)
    plugin = PLUGINS.build("ral", hidden_size=HIDDEN, **params)
    wrapped = PluggedModel(backbone=model, plugins={"ral": plugin})
    wrapped.request(training=plugin.needs(training=True), retrieval=plugin.needs(training=False))
    return wrapped


def batch(**kw):
    return make_batch([5, 3, 4], [4, 2, 3, 5, 2], [0, 0, 1, 2, 2], frame_pad=2, query_pad=1, **kw)


def test_csa_scores_every_pair_of_official_mssl_in_training():
    """On MS-SL's official own-video frame branch (Nq x Nq, targets), CSA scores the videos anew:
    (Nq, Nv) word-frame scores, positives from the batch again."""
    b = batch()
    bare = build("mssl", dropout=0.0).train()
    assert bare(b).scores["frame"].targets is not None
    out = plugged("mssl", csa=True, msra=False).train()(b)
    assert out.scores["frame"].targets is None
    assert out.scores["frame"].sim.shape == (b.num_queries, b.num_videos)


def test_registered_and_validates_params():
    assert "ral" in PLUGINS.names()
    with pytest.raises(ValueError, match="num_proxies"):
        RAL(hidden_size=8, num_proxies=0)
    with pytest.raises(ValueError, match="support"):
        RAL(hidden_size=8, support="all")
    with pytest.raises(ValueError, match="csa_input"):
        RAL(hidden_size=8, csa_input="unit")
    with pytest.raises(ValueError, match="mean_proxy"):
        RAL(hidden_size=8, mean_proxy="yes")
    assert list(RAL(hidden_size=8, msra=False, csa=False).parameters()) == []  # a no-op (ablation baseline)


def test_both_parts_off_is_the_bare_backbone():
    b = batch()
    model = plugged(msra=False, csa=False)
    model.eval()
    with torch.no_grad():
        out, bare = model(b), model.backbone(b)
    assert out.aux == {}
    assert all(torch.equal(out.scores[k].sim, bare.scores[k].sim) for k in bare.scores)


def test_masked_softmax_sums_to_one_and_ignores_padding():
    logits = torch.randn(4, 6)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1] * 6, [1, 0, 0, 0, 0, 0], [0] * 6], dtype=torch.bool)
    w = masked_softmax(logits, mask)
    assert torch.allclose(w[:3].sum(1), torch.ones(3))
    assert (w[~mask] == 0).all() and (w[3] == 0).all()
    # padding values never matter
    w2 = masked_softmax(logits.masked_fill(~mask, 1e4), mask)
    assert torch.allclose(w, w2)


def test_csa_word_weights_learned_and_average():
    plugin = RAL(hidden_size=8, msra=False)
    tokens, mask = torch.randn(3, 5, 8), torch.arange(5)[None] < torch.tensor([5, 2, 3])[:, None]
    g = plugin.word_weights(tokens, mask)
    assert torch.allclose(g.sum(1), torch.ones(3)) and (g[~mask] == 0).all()
    g_pad = plugin.word_weights(tokens.masked_fill(~mask[..., None], 99.0), mask)
    assert torch.allclose(g, g_pad)
    avg = RAL(hidden_size=8, msra=False, csa_weighting="average").word_weights(tokens, mask)
    assert torch.allclose(avg[1], torch.tensor([0.5, 0.5, 0, 0, 0]))


@pytest.mark.parametrize("official_padding", [False, True])
def test_confidence_scores_match_a_hand_loop(official_padding):
    """Masked: each word's max over the video's real frames.  Official padding (the code pads every video to
    max_frames = 7 here and its padded positions score 0): a video with fewer real frames than 7 takes
    max(0, that max) per word, so padding wins when every real frame scores below 0."""
    g = torch.Generator(DEVICE).manual_seed(0)
    words, frames = torch.randn(3, 4, 6, generator=g), torch.randn(5, 7, 6, generator=g)
    word_mask = torch.arange(4)[None] < torch.tensor([4, 1, 3])[:, None]
    lengths = [7, 2, 5, 1, 3]
    frame_mask = torch.arange(7)[None] < torch.tensor(lengths)[:, None]
    frames = frames.masked_fill(~frame_mask[..., None], 50.0)  # padding that would win a max
    weights = masked_softmax(torch.randn(3, 4, generator=g), word_mask)
    floor = torch.tensor([n < 7 for n in lengths]) if official_padding else None
    out = confidence_scores(words, weights, frames, frame_mask, with_logits=True, floor=floor)
    floored = 0
    for q in range(3):
        for v in range(5):
            sim = logit = 0.0
            for i in range(4):
                if not word_mask[q, i]:
                    continue
                cos = [float(torch.cosine_similarity(words[q, i], frames[v, j], dim=0)) for j in range(7) if frame_mask[v, j]]
                dot = [float(words[q, i] @ frames[v, j]) for j in range(7) if frame_mask[v, j]]
                if official_padding and lengths[v] < 7:
                    floored += max(cos) < 0
                    cos, dot = cos + [0.0], dot + [0.0]  # a padded position
                sim += float(weights[q, i]) * max(cos)
                logit += float(weights[q, i]) * max(dot)
            assert out.sim[q, v].item() == pytest.approx(sim, abs=1e-5)
            assert out.logits[q, v].item() == pytest.approx(logit, abs=1e-4)
    assert floored > 0 or not official_padding  # the case the switch is about happens here


def test_csa_official_padding_floors_the_videos_shorter_than_max_frames():
    b = batch()  # real frames 5, 3, 4, padded to 6 in the batch; the backbone's max_frames is larger
    model = plugged(msra=False).eval()
    assert model.plugins["ral"].csa_padding == "official"
    with torch.no_grad():
        out = model(b)
        q, v = model.encode_queries(b.queries, b.query_mask), model.encode_videos(b.clips, b.frames, b.frame_mask)
        frames, fmask = v.frame_tokens()
        words, word_mask = model.plugins["ral"].word_tokens(q)  # the plug-in's own text encoder's
        g = model.plugins["ral"].word_weights(words, word_mask)
        shorter = fmask.sum(dim=1) < model.backbone.max_frames
        assert shorter.all()
        expected = confidence_scores(words, g, frames, fmask, floor=shorter)
        masked = confidence_scores(words, g, frames, fmask)
    torch.testing.assert_close(out.scores["frame"].sim, expected.sim)
    assert not torch.allclose(expected.sim, masked.sim)  # some word's real frames all score below 0 here


def test_csa_input_normalized_differs_from_raw_and_sums_to_one():
    torch.manual_seed(0)
    normalized = RAL(hidden_size=8, msra=False)
    assert normalized.csa_input == "normalized"  # the official default
    raw = RAL(hidden_size=8, msra=False, csa_input="raw")
    raw.load_state_dict(normalized.state_dict())
    tokens = 3.0 * torch.randn(3, 5, 8)
    mask = torch.arange(5)[None] < torch.tensor([5, 2, 3])[:, None]
    g_norm, g_raw = normalized.word_weights(tokens, mask), raw.word_weights(tokens, mask)
    for g in (g_norm, g_raw):
        assert torch.allclose(g.sum(1), torch.ones(3)) and (g[~mask] == 0).all()
    assert not torch.allclose(g_norm, g_raw, atol=1e-4)
    # by hand: softmax over valid words of MLP(q_i / |q_i|) vs MLP(q_i)
    for q in range(3):
        n = int(mask[q].sum())
        for g, scale in ((g_norm, tokens[q, :n].norm(dim=-1, keepdim=True)), (g_raw, torch.ones(n, 1))):
            with torch.no_grad():
                logits = [float(normalized.confidence(tokens[q, i] / scale[i])) for i in range(n)]
            peak = max(logits)
            expected = [math.exp(x - peak) / sum(math.exp(y - peak) for y in logits) for x in logits]
            assert g[q, :n].tolist() == pytest.approx(expected, abs=1e-6)


def test_csa_normalized_scores_with_normalized_weights_and_logits_with_raw_ones():
    """Official: the cosine score weights words by MLP(normalised q), the raw-dot logits by MLP(q)."""
    b = batch()
    for csa_input in ("normalized", "raw"):
        model = plugged(msra=False, csa_input=csa_input, csa_padding="masked")
        model.eval()
        ral = model.plugins["ral"]
        with torch.no_grad():
            out = model(b)
            q, v = model.encode_queries(b.queries, b.query_mask), model.encode_videos(b.clips, b.frames, b.frame_mask)
            frames, fmask = v.frame_tokens()
            words, word_mask = ral.word_tokens(q)
            g_sim = ral.word_weights(words, word_mask, normalize=csa_input == "normalized")
            g_logit = ral.word_weights(words, word_mask, normalize=False)
            sim = confidence_scores(words, g_sim, frames, fmask).sim
            logits = confidence_scores(words, g_logit, frames, fmask, with_logits=True).logits
        assert torch.allclose(out.scores["frame"].sim, sim, atol=1e-6)
        assert torch.allclose(out.scores["frame"].logits, logits, atol=1e-5)


def test_confidence_scores_chunked_equals_unchunked(monkeypatch):
    import prvrlab.models.plugins.ral as ral

    words, frames = torch.randn(3, 4, 6), torch.randn(9, 5, 6)
    wm, fm = torch.ones(3, 4, dtype=torch.bool), torch.arange(5)[None] < torch.randint(1, 6, (9,))[:, None]
    w = masked_softmax(torch.randn(3, 4), wm)
    full = confidence_scores(words, w, frames, fm, with_logits=True)
    monkeypatch.setattr(ral, "_MAX_CHUNK_ELEMENTS", 60)
    part = confidence_scores(words, w, frames, fm, with_logits=True)
    assert torch.allclose(full.sim, part.sim) and torch.allclose(full.logits, part.logits)


def test_proxies_have_the_right_statistics():
    torch.manual_seed(0)
    mu, logvar = torch.tensor([[1.0, -2.0, 0.5]]), torch.tensor([[0.0, -2.0, 1.0]])
    p = sample_proxies(mu.expand(20000, 3), logvar.expand(20000, 3), 4, True)  # (N, 4, 3)
    assert p.shape == (20000, 4, 3)  # exactly K samples (Eq. 9, the official code)
    samples = p.reshape(-1, 3)
    assert torch.allclose(samples.mean(0), mu[0], atol=0.02)
    assert torch.allclose(samples.var(0), logvar[0].exp(), rtol=0.03)
    assert torch.equal(sample_proxies(mu, logvar, 4, False), mu[:, None])  # "w/o sampling": the mean only
    assert torch.equal(sample_proxies(mu, logvar, 4, False, mean_proxy=True), mu[:, None])


def test_mean_proxy_switch_puts_the_mean_first():
    torch.manual_seed(0)
    mu, logvar = torch.randn(5, 3), torch.randn(5, 3)
    p = sample_proxies(mu, logvar, 4, True, mean_proxy=True)  # (5, 5, 3)
    assert p.shape == (5, 5, 3)
    assert torch.equal(p[:, 0], mu)
    torch.manual_seed(1)
    with_mean = sample_proxies(mu, logvar, 4, True, mean_proxy=True)
    torch.manual_seed(1)
    assert torch.equal(with_mean[:, 1:], sample_proxies(mu, logvar, 4, True))  # the same K samples follow


def test_csa_off_leaves_the_backbone_scores_and_msra_off_adds_nothing():
    b = batch()
    model = plugged(csa=False)
    model.eval()
    bare = model.backbone
    with torch.no_grad():
        assert torch.equal(model(b).scores["frame"].sim, bare(b).scores["frame"].sim)
        out = plugged(msra=False)(b)
    assert out.aux == {}
    assert not any(name.startswith("plugins.ral.text_gaussian") for name, _ in plugged(msra=False).named_parameters())
    assert not any("confidence" in name for name, _ in plugged(csa=False).named_parameters())


def test_csa_replaces_only_the_frame_branch():
    b = batch()
    model = plugged(msra=False, csa_padding="masked")
    model.eval()
    with torch.no_grad():
        out, bare = model(b), model.backbone(b)
        assert torch.equal(out.scores["clip"].sim, bare.scores["clip"].sim)
        q, v = model.encode_queries(b.queries, b.query_mask), model.encode_videos(b.clips, b.frames, b.frame_mask)
        frames, fmask = v.frame_tokens()
        words, word_mask = model.plugins["ral"].word_tokens(q)
        g = model.plugins["ral"].word_weights(words, word_mask)
        expected = confidence_scores(words, g, frames, fmask)
        assert torch.allclose(out.scores["frame"].sim, expected.sim)
        assert torch.allclose(model.fuse(out.scores), 0.7 * out.scores["clip"].sim + 0.3 * expected.sim)


def test_retrieval_path_never_runs_msra(monkeypatch):
    model = plugged()
    model.eval()
    calls = []
    monkeypatch.setattr(RAL, "training_aux", lambda self, *a: calls.append(1) or {})
    monkeypatch.setattr(type(model.plugins["ral"].text_gaussian), "forward", lambda *a: pytest.fail("MSRA ran"))
    b = batch()
    with torch.no_grad():
        v = model.encode_videos(b.clips, b.frames, b.frame_mask)
        q = model.encode_queries(b.queries, b.query_mask)
        model.fuse(model.score(q, v))
    assert calls == []


def test_gmmformer_keeps_no_frame_tokens_at_retrieval_without_csa():
    b = batch()
    model = plugged(csa=False)
    model.train()
    assert "frame_tokens" in model.encode_videos(b.clips, b.frames, b.frame_mask).extra
    model.eval()
    assert "frame_tokens" not in model.encode_videos(b.clips, b.frames, b.frame_mask).extra


def test_msra_aux_support_set_and_single_query():
    b = batch()
    model = plugged(num_proxies=3)
    out = model(b)
    assert out.aux["ral.text_mu"].shape == (3, HIDDEN)  # one support set per video
    assert out.aux["ral.text_proxies"].shape == (3, 3, HIDDEN)  # K samples, no mean proxy
    assert out.aux["ral.video_proxies"].shape == (3, 3, HIDDEN)
    assert torch.allclose(out.aux["ral.text_sample_mean"], out.aux["ral.text_proxies"].mean(1))
    assert torch.allclose(out.aux["ral.video_sample_mean"], out.aux["ral.video_proxies"].mean(1))
    with_mean = plugged(num_proxies=3, mean_proxy=True)(b)
    assert with_mean.aux["ral.text_proxies"].shape == (3, 4, HIDDEN)
    assert torch.equal(with_mean.aux["ral.text_proxies"][:, 0], with_mean.aux["ral.text_mu"])
    assert torch.allclose(with_mean.aux["ral.video_sample_mean"], with_mean.aux["ral.video_proxies"][:, 1:].mean(1))
    assert out.aux["ral.text_video"].tolist() == [0, 1, 2]
    metrics = model.plugins["ral"].pop_step_metrics()
    assert set(metrics) == {"sigma_query", "sigma_video", "logvar_outside"} and metrics["sigma_video"] > 0
    assert model.plugins["ral"].pop_step_metrics() == {}  # popped once per step
    single = plugged(support="single", sampling=False)(b)
    assert single.aux["ral.text_mu"].shape == (5, HIDDEN)
    assert single.aux["ral.text_video"].tolist() == [0, 0, 1, 2, 2]
    assert single.aux["ral.text_proxies"].shape == (5, 1, HIDDEN)
    assert torch.equal(single.aux["ral.text_sample_mean"], single.aux["ral.text_mu"])  # no sampling: mu


def test_support_set_is_the_concatenation_of_the_videos_queries():
    """The set's Gaussian equals that of one query holding all the video's words (order-free)."""
    plugin = RAL(hidden_size=8, csa=False)
    plugin.eval()
    words = torch.randn(3, 4, 8)
    mask = torch.arange(4)[None] < torch.tensor([4, 2, 3])[:, None]
    from prvrlab.models.plugins.ral import _groups

    real, member = _groups(words, mask, torch.tensor([0, 0, 0]), 1)
    concat = torch.cat([words[i, : int(mask[i].sum())] for i in range(3)])
    mu, lv = plugin.text_gaussian(real, member)
    mu2, lv2 = plugin.text_gaussian(concat.flip(0), torch.ones(1, concat.shape[0], dtype=torch.bool))
    assert torch.allclose(mu, mu2, atol=1e-5) and torch.allclose(lv, lv2, atol=1e-5)


@pytest.mark.parametrize("aggregation", ["both", "local", "global"])
def test_aggregation_variants_build_only_their_parts(aggregation):
    agg = RAL(hidden_size=8, csa=False, aggregation=aggregation, heads="paper").text_gaussian.aggregate
    assert hasattr(agg, "global_fc") == (aggregation != "local")
    assert hasattr(agg, "gate_hidden") == (aggregation != "global")
    official = RAL(hidden_size=8, csa=False, aggregation=aggregation).video_gaussian
    assert hasattr(official, "sigma_pool_fc") == (aggregation != "local")
    assert hasattr(official, "mu_gate_hidden") == hasattr(official, "sigma_gate_hidden") == (aggregation != "global")


def hand_attention(x: torch.Tensor, hidden: torch.nn.Linear, score: torch.nn.Linear) -> torch.Tensor:
    """softmax_n(w2 . tanh(W1 x_n)) . X for one group's (n, D) tokens, one token at a time."""
    logits = torch.stack([score(torch.tanh(hidden(row))).squeeze() for row in x])  # (n,)
    return (torch.softmax(logits, dim=0)[:, None] * x).sum(dim=0)


def group_tokens(n: int = 5, dim: int = 8, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, dim, generator=torch.Generator().manual_seed(seed)) * 2


@pytest.mark.parametrize("aggregation", ["both", "local", "global"])
def test_paper_heads_are_eqs_6_and_7(aggregation):
    torch.manual_seed(0)
    encoder = RAL(hidden_size=8, csa=False, heads="paper", aggregation=aggregation).text_gaussian
    x = group_tokens()
    mu, logvar = encoder(x, torch.ones(1, 5, dtype=torch.bool))
    agg = encoder.aggregate
    total = torch.zeros(8)
    if aggregation != "local":
        total = total + agg.global_fc(x.mean(dim=0))  # x^g = FC(MeanPool(X))
    if aggregation != "global":
        total = total + hand_attention(x, agg.gate_hidden, agg.gate_score)  # x^l
    g = F.layer_norm(total, (8,), agg.norm.weight, agg.norm.bias)  # Eq. 7
    torch.testing.assert_close(mu[0], encoder.mean(g), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logvar[0], encoder.logvar(g), atol=1e-5, rtol=1e-5)  # unbounded by default


@pytest.mark.parametrize("aggregation", ["both", "local", "global"])
@pytest.mark.parametrize("side", ["text", "video"])
def test_official_heads_are_the_ral_prvr_codes(side, aggregation):
    """PIENet: mu = LayerNorm(p + sigmoid(FC(att_mu(X)))); UncertaintyModuleImage: log sigma =
    FC(att_sigma(X)) + FC2(p); p = the plain mean of the support set's words (text), the normalised mean
    of the normalised frames (video); logvar = 2 log sigma."""
    torch.manual_seed(1)
    plugin = RAL(hidden_size=8, csa=False, aggregation=aggregation)
    encoder = getattr(plugin, f"{side}_gaussian")
    x = group_tokens(seed=2)
    mu, logvar = encoder(x, torch.ones(1, 5, dtype=torch.bool))
    if side == "video":
        pooled = F.normalize(F.normalize(x, dim=-1).mean(dim=0), dim=0)
    else:
        pooled = x.mean(dim=0)
    mu_in, log_sigma = torch.zeros(8), torch.zeros(8)
    if aggregation != "local":
        mu_in, log_sigma = mu_in + pooled, log_sigma + encoder.sigma_pool_fc(pooled)
    if aggregation != "global":
        mu_in = mu_in + torch.sigmoid(encoder.mu_fc(hand_attention(x, encoder.mu_gate_hidden, encoder.mu_gate_score)))
        log_sigma = log_sigma + encoder.sigma_fc(hand_attention(x, encoder.sigma_gate_hidden, encoder.sigma_gate_score))
    expected_mu = F.layer_norm(mu_in, (8,), encoder.mu_norm.weight, encoder.mu_norm.bias)
    torch.testing.assert_close(mu[0], expected_mu, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logvar[0], 2 * log_sigma, atol=1e-5, rtol=1e-5)
    assert encoder.mu_norm.weight.shape == (8,)
    if aggregation != "global":
        assert encoder.mu_gate_hidden.weight.shape == encoder.sigma_gate_hidden.weight.shape == (4, 8)  # width D/2


def test_masked_softmax_counts_zero_slots_in_the_normaliser():
    """zero_slots: softmax over the row with that many more logits 0 appended, those entries dropped."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 9.0], [-3.0, -4.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    mask = torch.tensor([[True, True, True, False], [True, True, False, False], [False, False, False, False]])
    slots = torch.tensor([3, 2, 4])
    got = masked_softmax(logits, mask, zero_slots=slots)
    for r in range(3):
        real = [float(logits[r, j]) for j in range(4) if mask[r, j]]
        full = torch.softmax(torch.tensor(real + [0.0] * int(slots[r])), dim=0) if real else torch.zeros(0)
        expected = torch.zeros(4)
        expected[mask[r]] = full[: len(real)]
        torch.testing.assert_close(got[r], expected)
    assert torch.equal(masked_softmax(logits, mask, zero_slots=torch.zeros(3)), masked_softmax(logits, mask))
    big = masked_softmax(torch.tensor([[-200.0, -201.0]]), torch.ones(1, 2, dtype=torch.bool), zero_slots=torch.tensor([1]))
    assert float(big.sum()) < 1e-30 and torch.isfinite(big).all()  # the zero slots take all the weight, no overflow


@pytest.mark.parametrize("aggregation", ["both", "local"])
def test_official_heads_attend_over_zero_slots_as_over_zero_tokens(aggregation):
    """A zero token gives the bias-free gates logit 0 and adds nothing to the weighted sum: the heads'
    attentions with ``zero_slots`` equal those over the group with that many zero tokens appended
    (with ``aggregation: local``, where the pooled vector does not see them, the whole output)."""
    torch.manual_seed(3)
    encoder = RAL(hidden_size=8, csa=False, aggregation=aggregation).video_gaussian
    x = group_tokens(n=7, seed=4)  # two groups: tokens 0-3 and 4-6
    member = torch.tensor([[True] * 4 + [False] * 3, [False] * 4 + [True] * 3])
    slots = torch.tensor([2, 5])
    for g, (start, stop) in enumerate(((0, 4), (4, 7))):
        padded = torch.cat([x[start:stop], torch.zeros(int(slots[g]), 8)])
        for hidden, score in ((encoder.mu_gate_hidden, encoder.mu_gate_score), (encoder.sigma_gate_hidden, encoder.sigma_gate_score)):
            got = gated_attention(x, member, hidden, score, zero_slots=slots)[g]
            torch.testing.assert_close(got, hand_attention(padded, hidden, score), atol=1e-6, rtol=1e-5)
    mu, logvar = encoder(x, member, zero_slots=slots)
    plain_mu, plain_logvar = encoder(x, member)
    assert not torch.allclose(mu, plain_mu) and not torch.allclose(logvar, plain_logvar)
    if aggregation == "local":
        tokens = torch.cat([x[:4], torch.zeros(2, 8), x[4:], torch.zeros(5, 8)])
        groups = torch.tensor([[True] * 6 + [False] * 8, [False] * 6 + [True] * 8])
        want_mu, want_logvar = encoder(tokens, groups)
        torch.testing.assert_close(mu, want_mu, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(logvar, want_logvar, atol=1e-6, rtol=1e-5)


def test_official_heads_padding_pads_the_videos_to_max_frames_in_training():
    """heads_padding: official: each video's Gaussian heads see max_frames - length zero slots (the
    official code zero-pads every video to 128 frames and runs the heads' attentions unmasked), whatever
    the batch's padded length; ``masked``: the real frames only; the text side is not padded."""
    b = make_batch([6, 3, 4], [4, 2, 3, 5, 2], [0, 0, 1, 2, 2])  # padded to 6 in the batch
    out, models = {}, {}
    for padding in ("official", "masked"):
        torch.manual_seed(0)
        backbone = build("gmmformer", dropout=0.0, max_frames=9)
        torch.manual_seed(1)
        plugin = PLUGINS.build("ral", hidden_size=HIDDEN, csa=False, heads_padding=padding)
        models[padding] = model = PluggedModel(backbone=backbone, plugins={"ral": plugin})
        model.request(training=plugin.needs(training=True), retrieval=plugin.needs(training=False))
        out[padding] = model.train()(b).aux
    assert RAL(hidden_size=8).heads_padding == "official"
    model = models["official"]
    with torch.no_grad():
        frames, mask = model.encode_videos(b.clips, b.frames, b.frame_mask).frame_tokens()  # training mode
    for padding, slots in (("official", [3, 6, 5]), ("masked", [0, 0, 0])):
        for v, n in enumerate([6, 3, 4]):
            mu, _ = model.plugins["ral"].video_gaussian(frames[v, :n], torch.ones(1, n, dtype=torch.bool),
                                                        zero_slots=torch.tensor([slots[v]]))
            torch.testing.assert_close(out[padding]["ral.video_mu"][v], F.normalize(mu[0], dim=-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out["official"]["ral.text_mu"], out["masked"]["ral.text_mu"])
    with pytest.raises(ValueError, match="heads_padding"):
        RAL(hidden_size=8, heads_padding="zero")


def hand_official_text_heads(heads, tokens: torch.Tensor, real: torch.Tensor, zero_rows: int):
    """The official PIENet / UncertaintyModuleImage on one support set: (n, D) rows (``real``: the words
    the pooled mean reads) plus ``zero_rows`` zero rows, attentions unmasked; -> unit mu, logvar."""
    rows = torch.cat([tokens, torch.zeros(zero_rows, tokens.shape[1])])
    pooled = tokens[real].mean(dim=0)
    mu = heads.mu_norm(pooled + torch.sigmoid(heads.mu_fc(hand_attention(rows, heads.mu_gate_hidden, heads.mu_gate_score))))
    log_sigma = heads.sigma_fc(hand_attention(rows, heads.sigma_gate_hidden, heads.sigma_gate_score)) + heads.sigma_pool_fc(pooled)
    return F.normalize(mu, dim=-1), 2 * log_sigma  # unbounded, as the official heads


@pytest.mark.parametrize("support", ["set", "single"])
def test_official_text_heads_read_the_encoders_outputs_at_padded_words(support):
    """text_heads_padding: official (the RAL-PRVR code's support_set + probabilistic_text): a unit's rows
    are Lo slots per query (Lo: the batch's longest query, here 5 with the batch padded to 6), the slots past
    a query's end holding the word encoder's outputs there from zero features; with support: set,
    (support_pad_queries - n) * Lo zero rows more; the pooled mean reads the real words only.  ``masked``:
    the real words alone.  Garbage in the padded features changes nothing."""
    b = batch()  # query lengths 4 2 3 5 2, padded to 6; videos 0 0 1 2 2
    lengths = [4, 2, 3, 5, 2]
    aux = {}
    for padding in ("official", "masked"):
        model = plugged(csa=False, support=support, support_pad_queries=4, text_heads_padding=padding)
        aux[padding] = model.train()(b).aux
    ral = model.plugins["ral"]
    assert RAL(hidden_size=8).text_heads_padding == "official" and RAL(hidden_size=8).support_pad_queries == 26
    with torch.no_grad():
        zeroed = torch.where(b.query_mask[..., None], b.queries, 0)
        grid = ral.words.encode_padded(zeroed, b.query_mask)[:, :5]  # (Nq, Lo, D)
        units = [[0, 1], [2], [3, 4]] if support == "set" else [[j] for j in range(5)]
        for g, queries in enumerate(units):
            for padding, rows in (("official", [grid[j] for j in queries]),
                                  ("masked", [grid[j, : lengths[j]] for j in queries])):
                tokens = torch.cat(rows)
                real = torch.cat([torch.arange(len(r)) < lengths[j] for r, j in zip(rows, queries)])
                zero_rows = (4 - len(queries)) * 5 if padding == "official" and support == "set" else 0
                mu, logvar = hand_official_text_heads(ral.text_gaussian, tokens, real, zero_rows)
                torch.testing.assert_close(aux[padding]["ral.text_mu"][g], mu, atol=1e-5, rtol=1e-4)
                torch.testing.assert_close(aux[padding]["ral.text_logvar"][g], logvar, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(aux["official"]["ral.text_mu"], aux["masked"]["ral.text_mu"])
    torch.testing.assert_close(aux["official"]["ral.video_mu"], aux["masked"]["ral.video_mu"])
    garbage = b.queries + 5.0 * (~b.query_mask[..., None])  # other values in the padded features
    again = plugged(csa=False, support=support, support_pad_queries=4).train()
    assert torch.equal(again(dataclasses.replace(b, queries=garbage)).aux["ral.text_mu"], again(b).aux["ral.text_mu"])


def test_official_text_heads_need_the_plugins_own_word_encoder():
    """The backbone's word tokens have no outputs at padded positions: word_encoder: backbone with the official
    text padding is refused, naming the key; masked, the paper heads or MSRA off are fine; a bad
    support_pad_queries names itself."""
    model = build("gmmformer")
    with pytest.raises(PluginError, match="plugins.ral.text_heads_padding: official .* set plugins.ral.text_heads_padding: masked"):
        RAL(hidden_size=8, word_encoder="backbone").check_backbone(model, "gmmformer")
    for params in ({"text_heads_padding": "masked"}, {"heads": "paper"}, {"msra": False}):
        RAL(hidden_size=8, word_encoder="backbone", **params).check_backbone(model, "gmmformer")
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="support_pad_queries"):
            RAL(hidden_size=8, support_pad_queries=bad)
    with pytest.raises(ValueError, match="text_heads_padding"):
        RAL(hidden_size=8, text_heads_padding="zero")


def test_the_word_grid_is_a_training_forward_extra_and_leaves_csas_words_alone():
    """Only the training forward runs the word encoder over the padding; CSA reads the same words either way
    (zeros on padding), so the frame scores of the training forward are those of the masked setting."""
    b = batch()
    scores, extras = {}, {}
    for padding in ("official", "masked"):
        model = plugged(text_heads_padding=padding).eval()  # dropout off; model(b) is the training forward
        with torch.no_grad():
            out = model(b)
            retrieval = model.encode_queries(b.queries, b.query_mask)
        scores[padding], extras[padding] = out.scores["frame"].sim, set(out.query.extra)
        assert "ral.word_grid" not in retrieval.extra
        assert torch.equal(out.query.extra["ral.words"][~b.query_mask], torch.zeros(int((~b.query_mask).sum()), HIDDEN))
    assert "ral.word_grid" in extras["official"] and "ral.word_grid" not in extras["masked"]
    torch.testing.assert_close(scores["official"], scores["masked"], atol=1e-5, rtol=1e-5)


def test_official_padding_needs_a_backbone_with_max_frames():
    """Both official paddings pad to the backbone's max_frames: a backbone without it is refused, naming the
    key to switch, unless that part of RAL is off or masked."""
    model = build("gmmformer")
    model.max_frames = None
    for params, key in (({"csa": False}, "heads_padding"), ({"msra": False}, "csa_padding")):
        with pytest.raises(PluginError, match=f"plugins.ral.{key}: official .* set plugins.ral.{key}: masked"):
            RAL(hidden_size=8, **params).check_backbone(model, "nameless")
        RAL(hidden_size=8, **params, **{key: "masked"}).check_backbone(model, "nameless")
    RAL(hidden_size=8, csa=False, heads="paper").check_backbone(model, "nameless")  # no official heads


@pytest.mark.parametrize("heads", ["official", "paper"])
def test_log_variance_is_unbounded_as_the_official_code_or_clamped_by_the_switch(heads):
    """The official heads have no clamp: a log-variance head driven to 2 log sigma = 60 stays 60 and passes its
    gradient; ``logvar_range: clamped`` gives logvar_min / logvar_max there (and no gradient)."""
    x, member = group_tokens(), torch.ones(1, 5, dtype=torch.bool)
    results = {}
    for logvar_range in ("official", "clamped"):
        torch.manual_seed(3)
        plugin = RAL(hidden_size=8, csa=False, heads=heads, logvar_range=logvar_range, logvar_min=-4.0, logvar_max=7.0)
        encoder = plugin.text_gaussian
        last = encoder.sigma_fc if heads == "official" else encoder.logvar
        with torch.no_grad():
            last.weight.zero_()
            last.bias.copy_(torch.tensor([30.0, -30.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]) / (2 if heads == "official" else 1))
            if heads == "official":
                encoder.sigma_pool_fc.weight.zero_()
                encoder.sigma_pool_fc.bias.zero_()
        _, logvar = encoder(x, member)
        logvar.sum().backward()
        results[logvar_range] = (logvar[0].detach(), last.bias.grad.clone())
    unbounded, grad = results["official"]
    torch.testing.assert_close(unbounded[:3], torch.tensor([30.0, -30.0, 1.0]))
    assert (grad != 0).all()
    clamped, grad = results["clamped"]
    torch.testing.assert_close(clamped[:3], torch.tensor([7.0, -4.0, 1.0]))
    assert grad[0] == 0 and grad[1] == 0 and grad[2] != 0
    assert RAL(hidden_size=8).logvar_range == "official"
    with pytest.raises(ValueError, match="logvar_range"):
        RAL(hidden_size=8, logvar_range="bounded")


@pytest.mark.parametrize("logvar_range", ["official", "clamped"])
def test_the_share_of_log_variances_outside_the_clamp_is_logged(logvar_range):
    """``ral.logvar_outside``: the share of the step's log sigma^2 values (text and video units) at or beyond
    [logvar_min, logvar_max], i.e. what the clamp cuts, under either setting.  Two of the 16 text dimensions
    driven to +-30 (3 support sets, 3 videos) -> 2 * 3 of 2 * 3 * 16 values."""
    b = batch()
    model = plugged(csa=False, logvar_range=logvar_range).train()
    text = model.plugins["ral"].text_gaussian
    with torch.no_grad():
        text.sigma_fc.weight.zero_()
        text.sigma_pool_fc.weight.zero_()
        text.sigma_pool_fc.bias.zero_()
        text.sigma_fc.bias.zero_()
        text.sigma_fc.bias[:2] = torch.tensor([15.0, -15.0])  # logvar = 2 log sigma = +-30
    out = model(b)
    video = out.aux["ral.video_logvar"]
    assert video.abs().max() < 10  # the video heads stay inside
    assert model.plugins["ral"].pop_step_metrics()["logvar_outside"].item() == pytest.approx(6 / 96)


def test_the_official_heads_are_the_default():
    assert RAL(hidden_size=8).heads == "official"
    assert type(RAL(hidden_size=8).video_gaussian).__name__ == "OfficialGaussianEncoder"
    with pytest.raises(ValueError, match="heads"):
        RAL(hidden_size=8, heads="pie")


def test_rejects_a_backbone_without_frame_branch():
    plugin = RAL(hidden_size=8)
    model = build("ice_base") if "ice_base" in BACKBONES.names() else None
    if model is None:
        pytest.skip("ice_base not registered")
    with pytest.raises(PluginError, match="no 'frame' branch"):
        plugin.check_backbone(model, "ice_base")


def test_frame_tokens_needs_per_frame_embeddings():
    with pytest.raises(ValueError, match="per-frame"):
        VideoEmbedding(frame=torch.randn(2, 4)).frame_tokens()


@pytest.mark.parametrize("backbone", FRAME_BACKBONES)
def test_forward_backward_on_every_declared_backbone(backbone):
    from prvrlab.losses.ral_da import RALDistributionAlignmentLoss
    from prvrlab.losses.ral_pm import RALProxyMatchingLoss

    model = plugged(backbone)
    b = batch()
    out = model(b)
    loss = (
        out.scores["frame"].sim.diag().sum()
        + out.scores["frame"].logits.mean()
        + RALDistributionAlignmentLoss()(out, b, epoch=0)
        + RALProxyMatchingLoss()(out, b, epoch=0)
    )
    assert torch.isfinite(loss)
    loss.backward()
    ral = model.plugins["ral"]
    for name, p in ral.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


@pytest.mark.parametrize("backbone", FRAME_BACKBONES)
def test_no_nan_with_one_video_and_one_query(backbone):
    from prvrlab.losses.ral_da import RALDistributionAlignmentLoss
    from prvrlab.losses.ral_pm import RALProxyMatchingLoss

    model = plugged(backbone)
    b = make_batch([1], [1], [0])
    out = model(b)
    total = RALDistributionAlignmentLoss()(out, b, epoch=0) + RALProxyMatchingLoss()(out, b, epoch=0)
    total = total + out.scores["frame"].sim.sum()
    total.backward()
    assert torch.isfinite(total)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_unit_mean_normalises_the_means_before_sampling():
    b = batch()
    torch.manual_seed(3)
    unit = plugged(num_proxies=2)(b)
    torch.manual_seed(3)
    raw = plugged(num_proxies=2, unit_mean=False)(b)
    for side in ("text", "video"):
        norms = unit.aux[f"ral.{side}_mu"].norm(dim=-1)
        torch.testing.assert_close(norms, torch.ones_like(norms))  # official: unit-length means
        expected = torch.nn.functional.normalize(raw.aux[f"ral.{side}_mu"], dim=-1)
        torch.testing.assert_close(unit.aux[f"ral.{side}_mu"], expected)  # the same head, normalised
        assert not torch.allclose(raw.aux[f"ral.{side}_mu"].norm(dim=-1), torch.ones_like(norms))


@pytest.mark.parametrize("padded", [True, False])
def test_padding_slots_reach_no_gaussian_whatever_they_hold(padded):
    """Both layouts (every slot with a membership mask, the GPU's; real tokens only, the CPU's): padding counts
    for nothing, NaN included, and both give the Gaussians of the real words by hand."""
    from prvrlab.models.plugins.ral import _groups

    plugin = RAL(hidden_size=8, csa=False)
    plugin.eval()
    words = torch.randn(3, 4, 8, requires_grad=True)
    mask = torch.arange(4)[None] < torch.tensor([4, 2, 3])[:, None]
    rows = torch.tensor([0, 0, 1])
    tokens, member = _groups(words, mask, rows, 2, padded=padded)
    assert tokens.shape[0] == (12 if padded else 9) and member.shape == (2, tokens.shape[0])
    mu, lv = plugin.text_gaussian(tokens, member)
    poisoned = words.detach().masked_fill(~mask[..., None], float("nan"))
    mu_p, lv_p = plugin.text_gaussian(*_groups(poisoned, mask, rows, 2, padded=padded))
    assert torch.allclose(mu, mu_p, atol=1e-6) and torch.allclose(lv, lv_p, atol=1e-6)
    (mu.sum() + lv.sum()).backward()
    assert torch.equal(words.grad[~mask], torch.zeros(int((~mask).sum()), 8)) and words.grad[mask].abs().sum() > 0
    for group, real in ((0, torch.cat([words[0, :4], words[1, :2]])), (1, words[2, :3])):
        by_hand = plugin.text_gaussian(real.detach(), torch.ones(1, real.shape[0], dtype=torch.bool))
        assert torch.allclose(mu[group], by_hand[0][0], atol=1e-5) and torch.allclose(lv[group], by_hand[1][0], atol=1e-5)


def test_support_sets_follow_the_batchs_host_copy_and_skip_videos_without_queries():
    import dataclasses

    import numpy as np

    b = batch()  # query_video [0, 0, 1, 2, 2]
    host = np.array([0, 0, 2, 2, 2])  # as the host built it: video 1 has no query (the tensor is not read)
    out = plugged(num_proxies=2)(dataclasses.replace(b, query_video_host=host))
    assert out.aux["ral.text_video"].tolist() == [0, 2] and out.aux["ral.text_mu"].shape == (2, HIDDEN)
    bare = dataclasses.replace(b, query_video=torch.tensor(host), query_video_host=None)
    again = plugged(num_proxies=2)(bare)  # the same grouping read from the tensor: the same support sets
    assert torch.allclose(out.aux["ral.text_mu"], again.aux["ral.text_mu"], atol=1e-6)


@pytest.mark.parametrize("backbone", FRAME_BACKBONES)
def test_own_word_encoder_is_a_fresh_copy_of_the_backbones_query_encoder(backbone):
    """The official RAL model encodes the frame branch's words with a second text encoder
    (frame_branch_query_proj + frame_branch_query_encoder); word_encoder: own builds it from the backbone's
    query encoder: same layout, no pooling head, its own N(0, 0.02) draw, with the backbone's positional
    embedding (word_positions: shared, the official query_pos_embed) or one of its own."""
    for positions in ("own", "shared"):
        ral = plugged(backbone, msra=True, csa=True, word_positions=positions).plugins["ral"]
        own = dict(ral.words.named_parameters())
        theirs = {k: v for k, v in ral.host.query.named_parameters() if not k.startswith("pool.")}
        assert own.keys() == theirs.keys() and ral.words.pool is None
        assert all(own[k].shape == theirs[k].shape for k in own)
        drawn = [f"{n}.weight" for n, m in ral.words.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))]
        assert len(drawn) > 1 and not any(torch.equal(own[k], theirs[k]) for k in drawn if not k.startswith("pos."))
        assert (ral.words.pos is ral.host.query.pos) == (positions == "shared")
        assert torch.equal(own["pos.embedding.weight"], theirs["pos.embedding.weight"]) == (positions == "shared")
    model = plugged(backbone, msra=True, csa=True)
    ral = model.plugins["ral"]
    assert WORD_TOKENS not in ral.needs(training=True) and FRAME_TOKENS in ral.needs(training=False)
    b = batch()
    out = model.train()(b)
    t, packing = ral.words.eval().encode(b.queries, b.query_mask)
    ral.words.train()
    assert out.query.extra["ral.words"].shape == packing.unpack(t).shape
    (out.scores["frame"].sim.sum() + out.aux["ral.text_mu"].sum()).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in ral.words.named_parameters() if "layers" in n)


def test_frame_scores_read_the_plugins_words_or_the_backbones_by_the_switch():
    b = batch()
    for word_encoder in ("own", "backbone"):
        model = plugged(msra=False, word_encoder=word_encoder).eval()
        with torch.no_grad():
            before = model(b).scores["frame"].sim
            for p in model.backbone.query.layers.parameters():
                p.add_(0.1)  # the backbone's text encoder changes
            after = model(b).scores["frame"].sim
        assert torch.equal(before, after) == (word_encoder == "own")
        assert ("words" in dict(model.plugins["ral"].named_children())) == (word_encoder == "own")


def test_shared_positions_are_one_parameter_trained_by_both_text_encoders():
    """word_positions: shared: the plug-in's word tokens move with the backbone's positional embedding (and
    with nothing else of its query encoder); the optimiser holds the table once; its gradient is the sum
    of what the clip branch's query encoder and the plug-in's words send it."""
    from prvrlab.platform.train.optim import param_groups

    b = batch()
    for positions in ("shared", "own"):
        model = plugged(msra=False, word_positions=positions).eval()
        with torch.no_grad():
            before = model.encode_queries(b.queries, b.query_mask).extra["ral.words"]
            model.backbone.query.pos.embedding.weight.add_(0.5)
            after = model.encode_queries(b.queries, b.query_mask).extra["ral.words"]
        assert torch.equal(before, after) == (positions == "own")
        grouped = [p for group in param_groups(model, 0.01) for p in group["params"]]
        assert len(grouped) == len({id(p) for p in grouped}) == len(list(model.parameters()))
    model = plugged(msra=False).eval()
    table = model.backbone.query.pos.embedding.weight
    ral = model.plugins["ral"]

    def grad_of(loss) -> torch.Tensor:
        table.grad = None
        loss().backward()
        return table.grad.clone()

    clip_side = lambda: model.backbone.encode_queries(b.queries, b.query_mask).vectors["clip"].pow(2).sum()  # noqa: E731
    word_side = lambda: ral.words.encode(b.queries, b.query_mask)[0].pow(3).sum()  # noqa: E731
    both = grad_of(lambda: clip_side() + word_side())
    assert torch.allclose(both, grad_of(clip_side) + grad_of(word_side), atol=1e-6)
    assert grad_of(word_side).abs().sum() > 0 and grad_of(clip_side).abs().sum() > 0


def test_msra_only_encodes_its_words_in_training_alone():
    model = plugged(msra=True, csa=False).eval()
    b = batch()
    with torch.no_grad():
        retrieval = model.encode_queries(b.queries, b.query_mask)
        training = model(b)  # the training forward, whatever the module mode
    assert "ral.words" not in retrieval.extra  # nothing at retrieval reads them
    assert "ral.words" in training.query.extra and "ral.text_mu" in training.aux
