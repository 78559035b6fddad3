"""GMMFormer v2's layers as the official code builds them (``huangmozhi9527/GMMFormer_v2``,
``src/Models/gmmformerV2/model_components.py`` and ``model.py``), and the switches that give prvrlab's
layers from before checkpoint format 8.

The official forward pass is written here in plain torch from its formulas (nothing is imported from the
official repository): ``BertSelfAttention`` (Q/K/V, logits / sqrt(d_h) times the Gaussian window, -10000
on masked keys, softmax, the merged heads: no output projection), ``BertAttention`` (``norm1(x + attn)``,
then ``norm2(h + FeedForward(h))`` with ``FeedForward`` = Linear(D, 4D) -> ReLU -> Dropout -> Linear),
``BertCrossAttention`` (the same with one query, ``FeedForward(D, int(1 * D))``), ``DyGMMBlock`` (one
``BertAttention`` per width, the cross-attention of the ONE ``weight_token`` to each, layer1 -> ReLU ->
Dropout -> layer2 to one logit per time step, softmax over the widths / sft_factor) and the query encoder
(LinearLayer, positional embedding, ``BertAttention``, ``modular_vector_mapping`` pooling).  prvrlab's
weights are loaded into it and both are compared in eval mode.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from prvrlab.platform.presets import BEFORE_FORMAT, stored_behaviour
from prvrlab.registry import BACKBONES

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))  # the backbone test helpers
from test_backbones import build, make_batch, standard_batch  # noqa: E402
from train_helpers import check_a_format_7_model  # noqa: E402  (tests/platform is on the path: tests/conftest.py)

pytestmark = pytest.mark.parity

# The model switches a file written before format 8 is read with: prvrlab's earlier v2 layers.
OLD = {
    "attention_output": "projected",
    "query_activation": "gelu",
    "ffn_dropout": False,
    "cross_attention_dropout": False,
    "weight_token": "per_block",
}
OFFICIAL = {"attention_output": "official", "query_activation": "relu", "ffn_dropout": True,
            "cross_attention_dropout": True, "weight_token": "shared"}
REFERENCE = Path(__file__).resolve().parents[1] / "models" / "gmmformer_v2_format7_outputs.json"


# ---------------------------------------------------------------- the official forward pass, by hand


def official_window(length: int, wid: float) -> torch.Tensor:
    """``generate_gauss_weight(length, wid)``: rows centred at i/L, columns at linspace(0, 1, L), width
    clamp(wid, 0.01) / 9, each row divided by its maximum."""
    center = (torch.arange(length, dtype=torch.float32) / length)[:, None]
    cols = torch.linspace(0, 1, length)[None, :]
    width = torch.full((length, 1), float(wid)).clamp(1e-2) / 9
    weight = 0.3989422804014327 / width * torch.exp(-((cols - center) ** 2) / (2 * width**2))
    return weight / weight.max(dim=-1, keepdim=True)[0]


def self_attention(query, keys, mask, wq, bq, wk, bk, wv, bv, heads, wid=None):
    """``BertSelfAttention``: (N, Lq, D) queries, (N, L, D) keys/values, (N, L) key mask or None -> (N, Lq, D)."""
    N, Lq, D = query.shape
    L, dh = keys.shape[1], D // heads

    def split(y, n):
        return y.view(N, n, heads, dh).permute(0, 2, 1, 3)

    q, k, v = split(F.linear(query, wq, bq), Lq), split(F.linear(keys, wk, bk), L), split(F.linear(keys, wv, bv), L)
    scores = q @ k.transpose(-1, -2) / math.sqrt(dh)
    if wid is not None:
        scores = scores * official_window(L, wid)[None, None]
    if mask is not None:
        scores = scores + (1 - mask[:, None, None, :].float()) * -10000.0
    return (scores.softmax(-1) @ v).permute(0, 2, 1, 3).reshape(N, Lq, D)  # no output projection


def feed_forward(x, w1, b1, w2, b2):
    """``FeedForward`` in eval mode: Linear -> ReLU -> (Dropout) -> Linear."""
    return F.linear(F.relu(F.linear(x, w1, b1)), w2, b2)


def bert_attention(x, keys, mask, p, heads, wid=None):
    """``BertAttention`` (keys is x) / ``BertCrossAttention`` (x the query): post-norm, no output projection."""
    D = x.shape[-1]
    h = F.layer_norm(x + self_attention(x, keys, mask, *p["qkv"], heads, wid), (D,), *p["norm1"])
    return F.layer_norm(h + feed_forward(h, *p["ffn"]), (D,), *p["norm2"])


def input_stage(encoder, x):
    """``LinearLayer`` (LayerNorm -> Linear -> ReLU) and ``TrainablePositionalEncoding`` in eval mode."""
    x = F.relu(encoder.proj.linear(encoder.proj.norm(x)))
    pos = encoder.pos.embedding.weight[: x.shape[1]]
    return F.layer_norm(x + pos, (x.shape[-1],), encoder.pos.norm.weight, encoder.pos.norm.bias)


def query_layer_weights(layer, D):
    """prvrlab's query TransformerLayer as the official ``BertAttention``'s tensors."""
    w, b = layer.attention.qkv.weight.view(3, D, D), layer.attention.qkv.bias.view(3, D)
    return {
        "qkv": (w[0], b[0], w[1], b[1], w[2], b[2]),
        "norm1": (layer.norm_weight[0], layer.norm_bias[0]),
        "ffn": (layer.ffn[0].weight, layer.ffn[0].bias, layer.ffn[2].weight, layer.ffn[2].bias),
        "norm2": (layer.ffn_norm.weight, layer.ffn_norm.bias),
    }


def official_query(model, queries, mask, heads):
    """``encode_query``: (Nq, Lq, Dq) -> (Nq, D)."""
    x = input_stage(model.query, queries)
    x = bert_attention(x, x, mask, query_layer_weights(model.query.layers[0], x.shape[-1]), heads)
    scores = model.query.pool.score(x)  # (Nq, Lq, 1) modular_vector_mapping
    m = mask.float()[..., None]
    scores = scores * m + (1 - m) * -1e10  # mask_logits
    return torch.einsum("blm,bld->bmd", scores.softmax(1), x).squeeze(1)


def official_dygmm_block(block, x, mask, weight_token, heads, sft_factor):
    """``DyGMMBlock``: (N, L, D) with (N, L) mask or None -> (N, L, D)."""
    N, L, D = x.shape
    att = block.attention
    K = att.num_branches
    w, b = att.qkv.weight.view(3, K, D, D), att.qkv.bias.view(3, K, D)
    oo = []
    for k, sigma in enumerate(att.sigmas):
        params = {
            "qkv": (w[0, k], b[0, k], w[1, k], b[1, k], w[2, k], b[2, k]),
            "norm1": (block.norm1_weight[k], block.norm1_bias[k]),
            "ffn": (block.ffn_in.weight[k], block.ffn_in.bias[k], block.ffn_out.weight[k], block.ffn_out.bias[k]),
            "norm2": (block.norm2_weight[k], block.norm2_bias[k]),
        }
        oo.append(bert_attention(x, x, mask, params, heads, None if math.isinf(sigma) else sigma))
    ca = block.summary
    ca_params = {
        "qkv": (ca.query.weight, ca.query.bias, ca.key.weight, torch.zeros(D), ca.value.weight, ca.value.bias),
        "norm1": (ca.norm1.weight, ca.norm1.bias),
        "ffn": (ca.ffn[0].weight, ca.ffn[0].bias, ca.ffn[2].weight, ca.ffn[2].bias),
        "norm2": (ca.norm2.weight, ca.norm2.bias),
    }
    token = weight_token.view(1, 1, D).repeat(N, 1, 1)
    weight = torch.cat([bert_attention(token, o, mask, ca_params, heads) for o in oo], dim=1)  # (N, K, D)
    first, last = block.weight_head[0], block.weight_head[3]
    logits = F.linear(F.relu(first(weight)), last.weight[:L], last.bias[:L])  # layer2 with frame_len = L outputs
    weight = F.softmax(logits.permute(0, 2, 1) / sft_factor, dim=-1)  # (N, L, K)
    return (torch.stack(oo, dim=-1) * weight[:, :, None, :]).sum(-1)


def randomise_(model):
    """Weights far from their initialisation (LayerNorm affines and biases included) so that every
    parameter matters; phi / the weight token keep their N(0, 1) draw."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "phi" in name or name == "weight_token":
                continue
            if "norm" in name and ("weight" in name and "linear" not in name):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_((0.3 if p.dim() >= 2 else 0.1) * torch.randn(p.shape, generator=g))


def padded_to(x, mask, length):
    """The official collate: frames zero-padded to ``length`` (128 there; ``max_frames`` here)."""
    pad = length - x.shape[1]
    return torch.cat([x, x.new_zeros(x.shape[0], pad, x.shape[2])], 1), torch.cat([mask, mask.new_zeros(mask.shape[0], pad)], 1)


def test_default_v2_is_the_official_forward_pass():
    """Query encoder, the clip and frame TC-GMMBlocks (with ONE weight token) and both branches' scores
    equal the official formulas on prvrlab's weights, eval mode, to 1e-5; the frames padded to max_frames
    as the official collate pads them to 128, padding scoring 0 in the frame max (frame_padding: official)."""
    torch.manual_seed(0)
    heads, tau, max_frames = 2, 0.6, 16
    model = build("gmmformer_v2", num_heads=heads, tau=tau, max_frames=max_frames, dropout=0.2, attention_dropout=0.2)
    assert model.weight_token is not None and model.clip.layers[0].summary.phi is None
    assert model.clip.layers[0].attention.out is None and model.query.layers[0].attention.out is None
    assert model.clip.layers[0].summary.out is None
    randomise_(model)
    model.eval()
    batch = make_batch([7, 3, 1, 5], [4, 2, 6, 1, 3, 5, 2], [0, 0, 1, 2, 2, 2, 3], seed=3)
    with torch.no_grad():
        query = model.encode_queries(batch.queries, batch.query_mask)
        video = model.encode_videos(batch.clips, batch.frames, batch.frame_mask)
        scores = model.score(query, video)

        q = official_query(model, batch.queries, batch.query_mask, heads)
        token = model.weight_token  # the one weight_token of model.py, passed to both blocks
        clip = official_dygmm_block(model.clip.layers[0], input_stage(model.clip, batch.clips), None, token, heads, tau)
        frames, mask = padded_to(batch.frames, batch.frame_mask, max_frames)
        frame = official_dygmm_block(model.frame.layers[0], input_stage(model.frame, frames), mask, token, heads, tau)
        frame = torch.where(mask[..., None], frame, 0 * frame)

        def max_cosine(vq, ctx):  # get_clip_scale_scores
            return (F.normalize(ctx, dim=-1) @ F.normalize(vq, dim=-1).t()).permute(2, 1, 0).max(dim=1)[0]

    torch.testing.assert_close(query.vectors["clip"], q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(video.clip, clip, atol=1e-5, rtol=1e-5)
    real = batch.frame_mask
    torch.testing.assert_close(video.frame[real], frame[:, : real.shape[1]][real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(scores["clip"].sim, max_cosine(q, clip), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(scores["frame"].sim, max_cosine(q, frame), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("switch", sorted(OLD))
def test_each_old_value_moves_the_outputs_away_from_the_official_ones(switch):
    """Every switch acts: the official model and the one with this switch at its old value differ (eval mode,
    same seeds; the dropout switches in training mode, same dropout draws otherwise)."""
    batch = standard_batch()
    outs = []
    for value in (OFFICIAL[switch], OLD[switch]):
        torch.manual_seed(0)
        model = build("gmmformer_v2", dropout=0.3, attention_dropout=0.3, **{switch: value})
        randomise_(model)
        if switch in ("ffn_dropout", "cross_attention_dropout"):
            model.train()
            torch.manual_seed(1)
            outs.append(model.fuse(model(batch).scores).detach())
        else:
            model.eval()
            with torch.no_grad():
                outs.append(model.fuse(model.score(model.encode_queries(batch.queries, batch.query_mask),
                                                   model.encode_videos(batch.clips, batch.frames, batch.frame_mask))))
    assert not torch.allclose(outs[0], outs[1], atol=1e-4)


def test_the_old_values_reproduce_the_outputs_before_format_8():
    """With every switch at its old value the model computes what prvrlab computed before these switches
    existed: the scores of gmmformer_v2_format7_outputs.json were written by that code (2026-12-05, before
    the change) from this seeded construction, in eval mode and in one training forward with dropout 0.2
    on every sublayer and on the attention probabilities (its draws included)."""
    reference = json.loads(REFERENCE.read_text())
    torch.manual_seed(0)
    model = build("gmmformer_v2", dropout=0.2, attention_dropout=0.2, **OLD)
    batch = standard_batch()
    model.eval()
    with torch.no_grad():
        s = model.score(model.encode_queries(batch.queries, batch.query_mask),
                        model.encode_videos(batch.clips, batch.frames, batch.frame_mask), with_logits=True)
    model.train()
    torch.manual_seed(3)
    trained = model(batch).scores
    got = {"eval_clip": s["clip"].sim, "eval_frame": s["frame"].sim,
           "train_clip": trained["clip"].sim.detach(), "train_frame": trained["frame"].sim.detach()}
    for key, value in got.items():
        torch.testing.assert_close(value, torch.tensor(reference[key]), atol=1e-5, rtol=1e-5, msg=key)


def test_old_values_load_the_layout_of_before_and_the_new_defaults_refuse_it():
    """A state dict of the old layers (output projections, a phi per block) loads strictly into a model
    with the old switches, scores the same, and does not fit the official layout."""
    torch.manual_seed(0)
    saved = build("gmmformer_v2", **OLD)
    state = saved.state_dict()
    assert "clip.layers.0.attention.out.weight" in state and "frame.layers.0.summary.phi" in state
    assert "weight_token" not in state
    torch.manual_seed(1)
    fresh = build("gmmformer_v2", **OLD)
    fresh.load_state_dict(state)
    batch = standard_batch()
    for m in (saved, fresh):
        m.eval()
    with torch.no_grad():
        a, b = (m.fuse(m.score(m.encode_queries(batch.queries, batch.query_mask),
                               m.encode_videos(batch.clips, batch.frames, batch.frame_mask))) for m in (saved, fresh))
    assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="weight_token"):
        build("gmmformer_v2").load_state_dict(state)


def test_shared_weight_token_is_one_parameter_for_every_block():
    model = build("gmmformer_v2", num_blocks=2)
    summaries = [layer.summary for enc in (model.clip, model.frame) for layer in enc.layers]
    assert all(s.phi is None and s.token is model.weight_token for s in summaries)
    names = [n for n, _ in model.named_parameters()]
    assert names.count("weight_token") == 1 and not any(n.endswith("summary.phi") for n in names)
    per_block = build("gmmformer_v2", num_blocks=2, weight_token="per_block")
    assert per_block.weight_token is None
    tokens = [layer.summary.phi for enc in (per_block.clip, per_block.frame) for layer in enc.layers]
    assert len({id(t) for t in tokens}) == 4
    assert build("gmmformer_v2", aggregation="average").weight_token is None  # no cross-attention: no token


def test_official_ffns_are_relu_with_inner_dropout_and_the_cross_attention_ffn_is_d_wide():
    model = build("gmmformer_v2", dropout=0.25)
    query_ffn = model.query.layers[0].ffn
    assert isinstance(query_ffn[1][0], torch.nn.ReLU) and query_ffn[1][1].p == 0.25
    summary_ffn = model.clip.layers[0].summary.ffn
    assert summary_ffn[0].out_features == model.hidden_size  # FeedForward(D, int(1 * D))
    assert isinstance(summary_ffn[1][0], torch.nn.ReLU) and summary_ffn[1][1].p == 0.25
    assert model.clip.layers[0].ffn_dropout
    old = build("gmmformer_v2", dropout=0.25, **OLD)
    assert isinstance(old.query.layers[0].ffn[1], torch.nn.GELU)
    assert isinstance(old.clip.layers[0].summary.ffn[1], torch.nn.ReLU)
    assert not old.clip.layers[0].ffn_dropout
    assert old.clip.layers[0].summary.attn_dropout.p == 0.0


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"attention_output": "none"}, "attention_output"),
        ({"query_activation": "tanh"}, "query_activation"),
        ({"ffn_dropout": 1}, "ffn_dropout"),
        ({"cross_attention_dropout": "yes"}, "cross_attention_dropout"),
        ({"weight_token": "per_branch"}, "weight_token"),
    ],
)
def test_rejects_bad_switch_values(kwargs, param):
    with pytest.raises(ValueError, match=param):
        build("gmmformer_v2", **kwargs)


def test_other_backbones_keep_their_layers():
    """Only GMMFormer v2 has these switches; GMMFormer's and MamFusion's query layers keep their GELU FFN
    and output projection (GMMFormer's official BertSelfOutput has one)."""
    for name in BACKBONES.names():
        if name != "gmmformer_v2":
            assert not set(OLD) & set(BACKBONES.params(name)), name
    for name in ("gmmformer", "mamfusion"):
        model = build(name, ffn_size=None)
        layer = model.query.layers[0]
        assert layer.attention.out is not None and isinstance(layer.ffn[1], torch.nn.GELU), name


def test_a_format_7_v2_checkpoint_keeps_the_layers_it_was_trained_with(tiny_root, tmp_path):
    """A file written before format 8 stored none of these keys and holds the old layers' weights: evaluated
    as it was trained; the same weights claimed as format 8 are refused, not half-loaded."""
    check_a_format_7_model(tiny_root, tmp_path, "gmmformer_v2", OLD, OFFICIAL)
    old = stored_behaviour({"model": {"name": "gmmformer_v2"}}, 7)["model"]
    assert {k: old[k] for k in OLD} == OLD
    assert not set(OLD) & set(stored_behaviour({"model": {"name": "gmmformer_v2"}}, 8)["model"])
    assert {k: v for k, v in BEFORE_FORMAT[8]["model"].items() if k in OLD} == OLD
    # a stored value wins over the switch
    kept = stored_behaviour({"model": {"name": "gmmformer_v2", "weight_token": "shared"}}, 7)["model"]
    assert kept["weight_token"] == "shared" and kept["attention_output"] == "projected"
