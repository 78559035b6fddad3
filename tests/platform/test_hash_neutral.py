"""A parameter a component gained later leaves the config hash alone while it holds the value that does what
the component did before (``hash_neutral``): ICE's ``own_video: negative`` (session 62) had changed every ICE
config's hash, so a resubmitted ICE ablation would have trained its finished cells again."""

from __future__ import annotations

from pathlib import Path

from prvrlab.platform.config import load_raw, validate
from prvrlab.registry import BACKBONES, LOSSES, PLUGINS

REPO = Path(__file__).resolve().parents[2]
BEFORE_OWN_VIDEO = "1c187c9b1d16b5a5"  # configs/ice_base_ice_synth.yaml's hash at f7c941d, before the parameter


def test_the_neutral_value_keeps_the_hash_it_had_before():
    raw = load_raw(REPO / "configs" / "ice_base_ice_synth.yaml")
    cfg = validate(raw)
    assert cfg.losses["ice_corr"]["own_video"] == "negative"  # filled in by validation, as every default
    assert cfg.fingerprint() == BEFORE_OWN_VIDEO
    raw["losses"]["ice_corr"]["own_video"] = "ignore"
    assert validate(raw).fingerprint() != BEFORE_OWN_VIDEO


def test_every_declared_neutral_value_is_the_parameter_default():
    """A neutral value that is not the default would hide a changed default from the hash."""
    for registry in (BACKBONES, LOSSES, PLUGINS):
        for name in registry.names():
            neutral = getattr(registry.get(name), "hash_neutral", {})
            params = registry.params(name)
            for key, value in neutral.items():
                assert key in params and params[key].default == value, (name, key)
