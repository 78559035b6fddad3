"""GMMFormer v2 specifics: TC-GMMBlock aggregations, configurable sigmas, masked frame max."""

from __future__ import annotations

import math

import pytest
import torch
from test_backbones import build, make_batch, standard_batch

from prvrlab.models.base import QueryEmbedding, VideoEmbedding
from prvrlab.models.blocks import Packing
from prvrlab.models.gmmformer_v2 import AGGREGATIONS, LearnedQueryAttention, TCGMMBlock
from device_under_test import DEVICE


def block(aggregation: str, **kwargs) -> TCGMMBlock:
    params = {"hidden_size": 8, "num_heads": 2, "sigmas": [0.5, 3.0, "inf"], "ffn_size": 12, "max_len": 10}
    return TCGMMBlock(aggregation=aggregation, **{**params, **kwargs}).eval()


def packed_input(lengths: list[int], length: int, dim: int = 8) -> tuple[torch.Tensor, Packing]:
    mask = torch.arange(length)[None] < torch.tensor(lengths)[:, None]
    packing = Packing.from_mask(mask, len(lengths), length, DEVICE)
    return torch.randn(packing.num_tokens, dim), packing


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_every_aggregation_trains(aggregation):
    model = build("gmmformer_v2", aggregation=aggregation).train()
    out = model(standard_batch())
    (model.fuse(out.scores).sum() + out.scores["clip"].logits.sum()).backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
    assert model.clip.layers[0].aggregation == aggregation


def test_average_is_the_mean_of_the_branches():
    b = block("average")
    x, packing = packed_input([5, 2, 4], 5)
    with torch.no_grad():
        torch.testing.assert_close(b.forward_packed(x, packing), b.branches_packed(x, packing).mean(dim=0))


def test_learned_weights_start_uniform_and_follow_their_logits():
    b = block("learned", tau=0.5)
    x, packing = packed_input([4, 3], 4)
    with torch.no_grad():
        branches = b.branches_packed(x, packing)
        torch.testing.assert_close(b.forward_packed(x, packing), branches.mean(dim=0))
        b.branch_logits.copy_(torch.tensor([1.0, 0.0, -1.0]))
        w = torch.softmax(torch.tensor([2.0, 0.0, -2.0]), dim=0)  # logits / tau
        torch.testing.assert_close(b.forward_packed(x, packing), torch.einsum("k,knd->nd", w, branches))


def test_dynamic_weights_are_per_video_and_temporal_weights_per_time_step():
    x, packing = packed_input([4, 3, 1], 4)
    rows = packing.rows()
    with torch.no_grad():
        dyn = block("dynamic")
        w = dyn.branch_weights(dyn.branches_packed(x, packing), packing)  # (N, K)
        torch.testing.assert_close(w.sum(dim=1), torch.ones(len(w)))
        for r in range(3):
            assert torch.allclose(w[rows == r], w[rows == r][0].expand_as(w[rows == r]))
        tcm = block("temporal", tau=0.09)
        branches = tcm.branches_packed(x, packing)
        w = tcm.branch_weights(branches, packing)
        torch.testing.assert_close(w.sum(dim=1), torch.ones(len(w)))
        assert not torch.allclose(w[rows == 0][0], w[rows == 0][1])  # varies along time
        # by definition: softmax over branches of the MLP's output at each token's position, / tau
        logits = tcm.weight_head(tcm.summary(branches, packing))  # (B, K, max_len)
        expected = torch.softmax(logits[rows, :, packing.positions] / 0.09, dim=-1)
        torch.testing.assert_close(w, expected)
        out = tcm.forward_packed(x, packing)
        torch.testing.assert_close(out, torch.einsum("nk,knd->nd", w, branches))


def project_out(ca: LearnedQueryAttention, ctx: torch.Tensor) -> torch.Tensor:
    """The cross-attention's heads through its output projection, if it has one (attention_output: projected)."""
    return ctx if ca.out is None else ca.out(ctx)


@pytest.mark.parametrize("out_projection", [False, True])
def test_learned_query_attention_equals_naive_cross_attention(out_projection):
    torch.manual_seed(1)
    ca = LearnedQueryAttention(hidden_size=8, num_heads=2, dropout=0.0, out_projection=out_projection).eval()
    assert (ca.out is not None) == out_projection
    for lin in (ca.query, ca.value, ca.out):
        if lin is not None:
            torch.nn.init.normal_(lin.bias)
    x, packing = packed_input([4, 2], 4)
    branches = torch.randn(3, packing.num_tokens, 8)
    with torch.no_grad():
        got = ca(branches, packing)  # (B, K, D)
        rows = packing.rows()
        for b in range(2):
            for k in range(3):
                tokens = branches[k][rows == b]  # (n, D)
                q = ca.query(ca.phi).view(2, 4)
                keys = (tokens @ ca.key.weight.t()).view(-1, 2, 4)
                values = ca.value(tokens).view(-1, 2, 4)
                att = torch.softmax(torch.einsum("he,nhe->hn", q, keys) / 2.0, dim=-1)  # sqrt(4) = 2
                ctx = torch.einsum("hn,nhe->he", att, values).reshape(8)
                s = ca.norm1(ca.phi + project_out(ca, ctx))
                s = ca.norm2(s + ca.ffn(s))
                torch.testing.assert_close(got[b, k], s, atol=1e-5, rtol=1e-5)



@pytest.mark.parametrize("out_projection", [False, True])
def test_learned_query_attention_gradients_equal_the_naive_loop(out_projection):
    """Training mode without dropout: the gradients of the branch outputs and of phi equal autograd's through
    the per-(video, branch) loop of the test above, padding included (videos of 3, 1 and 4 of 4 tokens)."""
    torch.manual_seed(2)
    ca = LearnedQueryAttention(hidden_size=8, num_heads=2, dropout=0.0, out_projection=out_projection).train()
    x, packing = packed_input([3, 1, 4], 4)
    branches = torch.randn(2, packing.num_tokens, 8, requires_grad=True)
    weights = torch.randn(3, 2, 8)
    (ca(branches, packing) * weights).sum().backward()
    got_x, got_phi = branches.grad.clone(), ca.phi.grad.clone()
    branches.grad, ca.phi.grad = None, None
    rows, total = packing.rows(), 0.0
    for b in range(3):
        for k in range(2):
            tokens = branches[k][rows == b]  # (n, D)
            q = ca.query(ca.phi).view(2, 4)
            keys = (tokens @ ca.key.weight.t()).view(-1, 2, 4)
            att = torch.softmax(torch.einsum("he,nhe->hn", q, keys) / 2.0, dim=-1)
            ctx = torch.einsum("hn,nhe->he", att, ca.value(tokens).view(-1, 2, 4)).reshape(8)
            s = ca.norm1(ca.phi + project_out(ca, ctx))
            total = total + (ca.norm2(s + ca.ffn(s)) * weights[b, k]).sum()
    total.backward()
    torch.testing.assert_close(got_x, branches.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_phi, ca.phi.grad, atol=1e-5, rtol=1e-5)
    assert got_x.abs().sum() > 0

def test_sigmas_are_configurable():
    default = build("gmmformer_v2")
    assert default.sigmas == (0.1, 0.5, 1.0, 3.0, 5.0, 8.0, 10.0, math.inf)
    assert default.clip.layers[0].attention.num_branches == 8
    model = build("gmmformer_v2", sigmas=[1.0, "inf"], aggregation="learned")
    assert model.frame.layers[0].sigmas == (1.0, math.inf)
    assert model.frame.layers[0].branch_logits.shape == (2,)
    assert model.frame.layers[0].ffn_in.weight.shape[0] == 2
    single = build("gmmformer_v2", sigmas=[5.0])  # Fig. 5(b): one Gaussian block
    out = single.eval()(standard_batch())
    assert torch.isfinite(out.scores["clip"].sim).all()


@pytest.mark.parity
@pytest.mark.parametrize("frame_padding", ["masked", "official"])
def test_frame_max_ignores_padding_when_every_real_frame_scores_below_zero(frame_padding):
    """``masked``: padding never wins the max; ``official``: padded positions score 0, as the reference."""
    model = build("gmmformer_v2", frame_padding=frame_padding).eval()
    q = torch.tensor([[1.0] + [0.0] * 15])
    frames = torch.zeros(1, 4, 16)
    frames[0, 0, 0], frames[0, 0, 1] = -1.0, 0.5  # cos < 0
    frames[0, 1, 0], frames[0, 1, 1] = -0.2, 1.0  # cos < 0, the best real frame
    mask = torch.tensor([[True, True, False, False]])  # padding rows are zero vectors (cos 0)
    video = VideoEmbedding(clip=torch.randn(1, 3, 16), frame=frames, frame_mask=mask)
    query = QueryEmbedding(vectors={"clip": q, "frame": q})
    scores = model.score(query, video, with_logits=True)
    best = -0.2 / math.sqrt(0.04 + 1.0)
    if frame_padding == "official":  # 2 real frames < max_frames: the padded positions' 0 wins
        best_sim, best_logit = 0.0, 0.0
    else:
        best_sim, best_logit = best, -0.2
    assert scores["frame"].sim.item() == pytest.approx(best_sim, abs=1e-6)
    assert scores["frame"].logits.item() == pytest.approx(best_logit, abs=1e-6)
    full = VideoEmbedding(clip=torch.randn(1, 3, 16), frame=frames[:, :2], frame_mask=mask[:, :2])
    model.max_frames = 2  # a video filling max_frames has no padding: the real max, whatever the setting
    assert model.score(query, full)["frame"].sim.item() == pytest.approx(best, abs=1e-6)


def test_frame_embeddings_are_per_frame_and_zero_on_padding():
    model = build("gmmformer_v2").eval()
    batch = make_batch([5, 2], [3], [0], frame_pad=2)
    with torch.no_grad():
        video = model.encode_videos(batch.clips, batch.frames, batch.frame_mask)
    assert video.frame.shape == (2, 7, 16)
    assert torch.equal(video.frame_mask, batch.frame_mask)
    assert torch.all(video.frame[~batch.frame_mask] == 0)


def test_temporal_weights_need_max_len_outputs():
    b = block("temporal", max_len=3)
    x, packing = packed_input([4, 2], 4)
    with pytest.raises(ValueError, match="max_len=3"):
        b.forward_packed(x, packing)


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"aggregation": "max"}, "aggregation"),
        ({"tau": 0.0}, "tau"),
        ({"tau": float("inf")}, "tau"),
        ({"sigmas": []}, "sigmas"),
        ({"sigmas": [0.1, -1]}, "sigmas"),
        ({"num_blocks": 0}, "num_blocks"),
        ({"ffn_size": 0}, "ffn_size"),
        ({"clip_weight": -0.5}, "clip_weight"),
    ],
)
def test_rejects_bad_hyperparameters(kwargs, param):
    with pytest.raises(ValueError, match=param):
        build("gmmformer_v2", **kwargs)


def test_evaluation_budget_share_follows_the_number_of_branches():
    """4 / K of evaluation's video-batch budget for K Gaussian branches (GMMFormer's 4 take all of it);
    a plugged v2 passes its backbone's on."""
    from prvrlab.registry import PLUGINS
    from prvrlab.models.plugins.base import PluggedModel

    for sigmas, share in (([0.1, 0.5, 1.0, 3.0, 5.0, 8.0, 10.0, "inf"], 0.5), ([0.5, 1.0, 5.0, "inf"], 1.0), ([1.0, "inf"], 1.0),
                          ([0.5, 1.0, 2.0, 3.0, 5.0, "inf"], 4 / 6)):
        assert build("gmmformer_v2", sigmas=sigmas).encode_budget_share() == pytest.approx(share)
    backbone = build("gmmformer_v2", sigmas=[0.1, 0.5, 1.0, 3.0, 5.0, 8.0, 10.0, "inf"])
    assert build("gmmformer").encode_budget_share() == 1.0
    plugged = PluggedModel(backbone=backbone, plugins={"ral": PLUGINS.build("ral", hidden_size=16)})
    assert plugged.encode_budget_share() == 0.5

