"""data.max_frames / data.max_query_len beyond the backbone's position tables are refused at validation,
naming both keys, instead of failing at the first long video or query after the data and workers started."""

from __future__ import annotations

import glob

import pytest
import torch

from prvrlab.models.factory import build_model
from prvrlab.platform.config import ConfigError, load_config, validate


@pytest.mark.parametrize("key, past", [("max_frames", 128 + 5), ("max_query_len", 30 + 5)])
def test_a_data_length_past_the_models_table_is_refused_naming_both_keys(key, past):
    raw = load_config("configs/gmmformer_synth.yaml").to_dict()
    limit = raw["model"][key]
    assert past > limit
    raw["data"][key] = past
    with pytest.raises(ConfigError, match=rf"data\.{key}={past} exceeds model\.{key}={limit}"):
        validate(raw)
    raw["model"][key] = past  # the table grown to hold it: accepted
    assert getattr(validate(raw).data, key) == past


def test_what_the_check_refuses_would_fail_at_the_first_long_batch():
    """The refusal is not stricter than the model: a backbone given a longer sequence than its table raises."""
    cfg = load_config("configs/gmmformer_synth.yaml")
    model = build_model(cfg.model, video_dim=8, query_dim=6).eval()
    L = cfg.model["max_query_len"] + 1
    with torch.no_grad(), pytest.raises(ValueError, match="exceeds"):
        model.encode_queries(torch.randn(1, L, 6), torch.ones(1, L, dtype=torch.bool))


def test_every_shipped_config_fits_its_data_in_its_tables():
    """ice_base_activitynet.yaml read 64-token ActivityNet queries into a 30-position table."""
    for path in sorted(glob.glob("configs/*.yaml")):
        cfg = load_config(path)  # validates
        for key in ("max_frames", "max_query_len"):
            if key in cfg.model:
                assert getattr(cfg.data, key) <= cfg.model[key], (path, key)
