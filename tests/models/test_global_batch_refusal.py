"""A plug-in that has not opted in to the global batch is refused naming the class attribute that opts in."""

from __future__ import annotations

from pathlib import Path

import pytest

from prvrlab.platform.config import ConfigError, load_config, validate

REPO = Path(__file__).resolve().parents[2]


def test_the_refusal_names_supports_global_batch(monkeypatch):
    from prvrlab.registry import PLUGINS

    raw = load_config(REPO / "configs" / "gmmformer_v2_ral_synth.yaml").to_dict()
    assert raw["train"]["num_workers"] > 1 and raw["train"]["ddp_batch"] == "global"
    monkeypatch.setattr(PLUGINS.get("ral"), "supports_global_batch", False)  # a plug-in that has not opted in
    with pytest.raises(ConfigError) as err:
        validate(raw)
    message = str(err.value)
    assert "plugins.ral: 'ral' computes on each DDP rank's share of a batch" in message
    assert "its class does not declare supports_global_batch = True" in message
    assert message.endswith("set train.ddp_batch: local (or train.num_workers: 1)")
