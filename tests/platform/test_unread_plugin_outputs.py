"""A plug-in part whose training outputs no weighted loss term reads trains on nothing: RAL's MSRA without
L_DA or L_PM (the README's plug-in snippet on a plain config) is refused, naming the losses that read them."""

from __future__ import annotations

from pathlib import Path

import pytest

from prvrlab.platform.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]
RAL = REPO / "configs" / "gmmformer_v2_ral_synth.yaml"
PLAIN = REPO / "configs" / "gmmformer_synth.yaml"


def test_msra_with_no_loss_term_reading_it_is_refused_naming_the_readers_and_the_switch():
    with pytest.raises(ConfigError) as caught:
        load_config(PLAIN, {"plugins": {"ral": {"msra": True, "csa": True, "num_proxies": 6}}})
    message = str(caught.value)
    assert "plugins.ral: no loss term with a weight > 0 reads its training outputs" in message
    assert "loss: 'ral_da' or 'ral_pm'" in message and "plugins.ral.msra" in message


def test_msra_with_its_losses_at_weight_0_is_refused_too():
    with pytest.raises(ConfigError, match="plugins.ral: no loss term"):
        load_config(RAL, {"losses.ral_da.weight": 0, "losses.ral_pm.weight": 0})


@pytest.mark.parametrize("overrides", [
    {},  # both readers
    {"losses.ral_pm.weight": 0},  # L_DA alone reads some of MSRA's outputs: RAL Table 2's w/o L_PM
    {"losses.ral_da.weight": 0},
    {"plugins.ral.msra": False, "losses.ral_da.weight": 0, "losses.ral_pm.weight": 0},  # CSA only: no training outputs
])
def test_a_plugin_whose_outputs_some_loss_reads_or_that_has_none_is_accepted(overrides):
    cfg = load_config(RAL, overrides)
    assert "ral" in cfg.plugins
