"""The ``corrected`` preset is gathered from the components: a loss, plug-in or backbone declares its own
``corrected`` values and ``--preset corrected`` applies them with no edit to the platform's presets."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from prvrlab.losses.base import Loss
from prvrlab.platform.presets import CORRECTED_PLATFORM, PRESETS, apply_preset, corrected_switches
from prvrlab.registry import BACKBONES, LOSSES, PLUGINS


class FixedMarginLoss(Loss):
    """A stand-in loss whose official default is a defect its corrected value fixes."""

    corrected: ClassVar[dict[str, Any]] = {"margin": 0.3}

    def __init__(self, *, margin: float = 0.1) -> None:
        super().__init__()
        self.margin = margin


def test_a_registered_losss_corrected_values_join_the_preset(monkeypatch):
    monkeypatch.setitem(LOSSES._items, "test_fixed_margin", FixedMarginLoss)
    assert PRESETS["corrected"]["loss:test_fixed_margin"] == {"margin": 0.3}
    raw = {"losses": {"a": {"loss": "test_fixed_margin", "weight": 1.0}, "b": {"loss": "triplet", "margin": 0.1}}}
    out = apply_preset(raw, "corrected")
    assert out["losses"]["a"]["margin"] == 0.3 and out["losses"]["b"]["margin"] == 0.1


def test_the_preset_is_the_platforms_sections_and_each_components_values():
    switches = corrected_switches()
    assert {k: switches[k] for k in CORRECTED_PLATFORM} == CORRECTED_PLATFORM
    expected_model: dict[str, Any] = {}
    for name in BACKBONES.names():
        expected_model.update(getattr(BACKBONES.get(name), "corrected", {}))
    assert switches["model"] == expected_model and expected_model
    for prefix, registry in (("plugins.", PLUGINS), ("loss:", LOSSES)):
        for name in registry.names():
            assert switches.get(f"{prefix}{name}", {}) == getattr(registry.get(name), "corrected", {})


def test_backbones_that_disagree_on_a_shared_key_are_refused_by_name(monkeypatch):
    gmmformer = BACKBONES.get("gmmformer")
    clash = type("Clash", (gmmformer,), {"corrected": {"window": "official"}})
    monkeypatch.setitem(BACKBONES._items, "test_clash", clash)
    with pytest.raises(ValueError, match=r"backbone '(test_clash|gmmformer\w*|mamfusion)': corrected model.window="):
        corrected_switches()


def test_the_gathered_preset_is_the_one_presets_py_wrote_out_before():
    """The preset as presets.py held it until 2026-12-07 (session 63), when the components took it over."""
    assert PRESETS["corrected"] == {
        "model": {
            "window": "centred", "window_length": "real", "frame_padding": "masked", "frame_training": "all_pairs",
            "norm_decay": False, "mamba_norm_decay": False,
        },
        "data": {"last_bin": "inclusive", "normalize": "exact"},
        "train": {"warmup": "shifted", "clip_grad": "global", "early_stop": "at_patience"},
        "plugins.ral": {
            "csa_padding": "masked", "heads_padding": "masked", "text_heads_padding": "masked",
            "logvar_range": "clamped", "norm_decay": False,
        },
        "loss:ral_pm": {"formulation": "paper"},
        "loss:ral_da": {"formulation": "paper"},
    }
