"""MS-SL specifics: proposals against a brute-force loop, scores against their per-pair definition."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_backbones import build, make_batch, standard_batch

import prvrlab.models.mssl as mssl
from prvrlab.models.mssl import num_proposals, sliding_window_proposals


def loop_proposals(x: torch.Tensor, max_window: int) -> torch.Tensor:
    out = []
    for b in range(x.shape[0]):
        rows = []
        for k in range(1, min(max_window, x.shape[1]) + 1):
            for s in range(x.shape[1] - k + 1):
                rows.append(x[b, s : s + k].mean(dim=0))
        out.append(torch.stack(rows))
    return torch.stack(out)


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
    assert not torch.allclose(out.query.vectors["clip"], out.query.vectors["frame"])
    assert build("mssl", max_window=3).eval()(batch).video.clip.shape[1] == num_proposals(8, 3)


def test_scores_match_their_per_pair_definition():
    model = build("mssl").eval()
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


def test_frame_branch_gets_gradients_through_the_key_clip():
    model = build("mssl").train()
    out = model(make_batch([3, 2], [2, 2], [0, 1]))
    out.scores["frame"].sim.sum().backward()
    assert model.clip.layers[0].attention.qkv.weight.grad.abs().sum() > 0  # via the gathered key clip
    assert model.frame_key_value.weight.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"max_window": 0}, "max_window"),
        ({"ffn_size": -1}, "ffn_size"),
        ({"hidden_size": 10, "num_heads": 4}, "num_heads"),
        ({"dropout": 1.0}, "dropout"),
        ({"frame_weight": -1.0}, "frame_weight"),
    ],
)
def test_rejects_bad_hyperparameters(kwargs, param):
    with pytest.raises(ValueError, match=param):
        build("mssl", **kwargs)
