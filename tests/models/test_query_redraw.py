"""``query_redraw`` (GMMFormer, GMMFormer v2, MamFusion): the training forward encodes the queries a second time,
as the reference code's ``forward`` does for its query-level losses (GMMFormer / v2: query-diverse and
optimal matching read it; MamFusion: its batch fusion is made from it)."""

from __future__ import annotations

import pytest
import torch
from test_backbones import build, standard_batch

from device_under_test import DEVICE


def by_hand(model, batch, seed: int):
    """The video embedding and the two query encodings of a training forward, in its order, from ``seed``."""
    torch.manual_seed(seed)
    video = model.encode_videos(batch.clips, batch.frames, batch.frame_mask)
    first = model.encode_queries(batch.queries, batch.query_mask)
    second = model.encode_queries(batch.queries, batch.query_mask)
    return video, first, second


@pytest.mark.parametrize("backbone", ["gmmformer", "gmmformer_v2", "mamfusion"])
def test_redrawn_is_a_second_dropout_draw_of_the_queries(backbone):
    model = build(backbone, dropout=0.3, query_redraw=True).to(DEVICE)
    batch = standard_batch().to(DEVICE)
    assert model.batch_vector_names() == ("redrawn",)
    model.train()
    torch.manual_seed(5)
    out = model(batch)
    video, first, second = by_hand(model, batch, 5)
    torch.testing.assert_close(out.query.vectors["clip"], first.vectors["clip"])
    torch.testing.assert_close(out.query.vectors["redrawn"], second.vectors["clip"])
    assert (second.vectors["clip"] - first.vectors["clip"]).abs().max() > 1e-3  # another dropout draw
    if backbone == "mamfusion":  # the batch fusion is made from the second encoding, as the reference's
        torch.testing.assert_close(out.query.vectors["fused"], model._batch_fusion(second.vectors["clip"], video.frame))
    assert "redrawn" not in out.scores  # retrieval and its scores never see it
    model.eval()
    quiet = model(batch)  # no dropout: the second encoding is the first
    torch.testing.assert_close(quiet.query.vectors["redrawn"], quiet.query.vectors["clip"], atol=0, rtol=0)


@pytest.mark.parametrize("backbone", ["gmmformer", "gmmformer_v2", "mamfusion"])
def test_without_query_redraw_the_queries_are_encoded_once(backbone):
    model = build(backbone, dropout=0.3).to(DEVICE).train()
    batch = standard_batch().to(DEVICE)
    assert model.batch_vector_names() == ()
    torch.manual_seed(5)
    out = model(batch)
    assert "redrawn" not in out.query.vectors
    if backbone == "mamfusion":  # fused from the one encoding
        video, first, _ = by_hand(model, batch, 5)
        torch.testing.assert_close(out.query.vectors["fused"], model._batch_fusion(first.vectors["clip"], video.frame))


def test_a_loss_may_read_redrawn_only_with_query_redraw(tmp_path):
    from prvrlab.platform.config import ConfigError, validate

    raw = {
        "name": "t", "data": {"root": str(tmp_path), "collection": "synth", "visual_feature": "f"},
        "model": {"name": "gmmformer_v2", "hidden_size": 16, "num_heads": 2},
        "losses": {
            "clip_nce": {"loss": "infonce", "weight": 1.0, "branch": "clip"},
            "om": {"loss": "optimal_matching", "weight": 0.1, "branch": "redrawn"},
        },
        "tracking": {"uri": f"sqlite:///{tmp_path / 'm.db'}"},
    }
    with pytest.raises(ConfigError, match="losses.om.branch: 'redrawn' is not a branch of backbone 'gmmformer_v2'"):
        validate(raw)
    raw["model"]["query_redraw"] = True
    assert validate(raw).losses["om"]["branch"] == "redrawn"
    raw["losses"]["clip_nce"]["branch"] = "redrawn"  # InfoNCE reads a branch's scores: redrawn has none
    with pytest.raises(ConfigError, match="losses.clip_nce.branch: 'redrawn' is not a branch of backbone 'gmmformer_v2'"):
        validate(raw)
