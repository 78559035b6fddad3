"""Base model of the ICE/IRM/TCP paper: alpha weighting and the two branches' definitions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_backbones import build, make_batch, standard_batch

from prvrlab.models.blocks import AdditiveAttentionPooling, Packing
from device_under_test import DEVICE


def test_branches_and_default_alpha():
    model = build("ice_base")
    assert model.score_weights == {"moment": 0.7, "video": 0.3}  # the paper's alpha = 0.7


def test_alpha_weighting():
    model = build("ice_base", moment_weight=0.6, video_weight=0.4).eval()
    with torch.no_grad():
        out = model(standard_batch())
    expected = 0.6 * out.scores["moment"].sim + 0.4 * out.scores["video"].sim
    torch.testing.assert_close(model.fuse(out.scores), expected)
    only_moment = build("ice_base", moment_weight=1.0, video_weight=0.0)
    torch.testing.assert_close(only_moment.fuse(out.scores), out.scores["moment"].sim)


def test_scores_match_their_definition():
    model = build("ice_base").eval()
    batch = standard_batch()
    with torch.no_grad():
        out = model(batch)
    q = out.query.vectors["moment"]
    assert q is out.query.vectors["video"]
    assert out.video.clip.shape == (4, 8, 16) and out.video.frame.shape == (4, 16)
    for i in range(batch.num_queries):
        for v in range(batch.num_videos):
            cos_m = F.cosine_similarity(q[i][None], out.video.clip[v], dim=-1).max()
            assert out.scores["moment"].sim[i, v].item() == pytest.approx(cos_m.item(), abs=1e-5)
            cos_v = F.cosine_similarity(q[i], out.video.frame[v], dim=0)
            assert out.scores["video"].sim[i, v].item() == pytest.approx(cos_v.item(), abs=1e-5)


def test_additive_attention_pooling_matches_hand_computation():
    torch.manual_seed(0)
    pool = AdditiveAttentionPooling(hidden_size=4, attention_size=3)
    x = torch.randn(2, 3, 4)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    got = pool(x, mask)
    for b in range(2):
        n = int(mask[b].sum())
        e = torch.stack([pool.score.weight[0] @ torch.tanh(pool.project(x[b, j])) for j in range(n)])
        expected = (torch.softmax(e, dim=0)[:, None] * x[b, :n]).sum(dim=0)
        torch.testing.assert_close(got[b], expected)
    packing = Packing.from_mask(mask, 2, 3, DEVICE)
    torch.testing.assert_close(pool.forward_packed(packing.pack(x), packing), got)


def test_several_layers_and_one_query():
    model = build("ice_base", num_layers=2).eval()
    assert len(model.frame.layers) == 2
    out = model(make_batch([2], [1], [0]))
    assert out.scores["moment"].sim.shape == (1, 1)


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"moment_weight": -0.1}, "moment_weight"),
        ({"video_weight": -1.0}, "video_weight"),
        ({"moment_weight": 0.0, "video_weight": 0.0}, "score weights"),
        ({"num_layers": 0}, "num_layers"),
        ({"ffn_size": -1}, "ffn_size"),
    ],
)
def test_rejects_bad_hyperparameters(kwargs, param):
    with pytest.raises(ValueError, match=param):
        build("ice_base", **kwargs)
