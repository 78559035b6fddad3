"""The shipped configs of MS-SL, GMMFormer v2 and the ICE base model validate and carry the papers' numbers."""

from __future__ import annotations

from pathlib import Path

import pytest

from prvrlab.platform.config import load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
BACKBONES = ("mssl", "gmmformer_v2", "ice_base")
DATASETS = ("synth", "tvr", "activitynet", "charades")


@pytest.mark.parametrize("backbone", BACKBONES)
@pytest.mark.parametrize("dataset", DATASETS)
def test_config_validates_for_its_backbone(backbone, dataset):
    cfg = load_config(CONFIGS / f"{backbone}_{dataset}.yaml")  # also builds the model on the meta device
    assert cfg.backbone == backbone
    assert cfg.name == f"{backbone}_{dataset}"
    triplets = [spec for spec in cfg.losses.values() if spec["loss"] == "triplet"]
    assert len(triplets) == 2 and all(spec["weight"] == 1.0 for spec in triplets)


# GMMFormer v2 paper, Table 7: lr, delta, margin, tau, lambda_c, lambda_f, lambda_d, lambda_o
TABLE_7 = {
    "activitynet": (2.5e-4, 0.2, 0.2, 0.6, 2e-2, 4e-2, 3e-3, 1.1e-1),
    "tvr": (3e-4, 0.15, 0.1, 0.09, 5e-2, 4e-2, 8e-5, 9e-2),
    "charades": (2e-4, 0.2, 0.2, 0.6, 2e-2, 4e-2, 3e-3, 1e-1),
}


@pytest.mark.parametrize("dataset", list(TABLE_7))
def test_gmmformer_v2_configs_follow_table_7(dataset):
    cfg = load_config(CONFIGS / f"gmmformer_v2_{dataset}.yaml")
    lr, delta, margin, tau, lc, lf, ld, lo = TABLE_7[dataset]
    losses = cfg.losses
    assert cfg.train.lr == pytest.approx(lr)
    assert cfg.model["tau"] == pytest.approx(tau) and cfg.model["aggregation"] == "temporal"
    assert len(cfg.model["sigmas"]) == 8
    assert (cfg.model["clip_weight"], cfg.model["frame_weight"]) == (0.7, 0.3)
    assert losses["clip_triplet"]["margin"] == losses["frame_triplet"]["margin"] == pytest.approx(margin)
    assert losses["clip_nce"]["weight"] == pytest.approx(lc)
    assert losses["frame_nce"]["weight"] == pytest.approx(lf)
    div = losses["query_diverse"]
    assert div["loss"] == "query_diverse_focal" and div["weight"] == pytest.approx(ld)
    assert (div["alpha"], div["delta"], div["gamma"]) == pytest.approx((32.0, delta, 1.0))
    assert losses["optimal_matching"]["loss"] == "optimal_matching"
    assert losses["optimal_matching"]["weight"] == pytest.approx(lo)


def test_mssl_charades_weights_clip_and_frame_equally():
    assert load_config(CONFIGS / "mssl_charades.yaml").model["clip_weight"] == 0.5
    assert load_config(CONFIGS / "mssl_tvr.yaml").model["clip_weight"] == 0.7


def test_ice_base_alpha():
    cfg = load_config(CONFIGS / "ice_base_tvr.yaml")
    assert (cfg.model["moment_weight"], cfg.model["video_weight"]) == (0.7, 0.3)
