"""A plug-in part whose parameters train only through its training outputs, which no loss term of the config
reads, trains on nothing: RAL's MSRA without L_DA or L_PM (the README's plug-in snippet on a plain config), ICE's
TCP without L_tcp, are refused naming the losses that read them. A term set to weight 0 is a deliberate
ablation and counts; a plug-in without such parts (ARL without its cross-model encoder, a diagnostic run) is
not checked."""

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
    assert "plugins.ral.msra: no loss term reads its training outputs" in message
    assert "loss: 'ral_da' or 'ral_pm'" in message and message.endswith("or set plugins.ral.msra: false")


def test_msra_without_its_loss_terms_is_refused_but_with_them_at_weight_0_is_an_ablation():
    raw_losses = load_config(RAL).to_dict()["losses"]
    kept = {k: v for k, v in raw_losses.items() if k not in ("ral_da", "ral_pm")}
    with pytest.raises(ConfigError, match="plugins.ral.msra: no loss term reads"):
        load_config(RAL, {"losses": kept})
    assert load_config(RAL, {"losses.ral_da.weight": 0, "losses.ral_pm.weight": 0}).plugins["ral"]["msra"] is True


@pytest.mark.parametrize("overrides", [
    {},  # both readers
    {"losses.ral_pm.weight": 0},  # L_DA alone reads some of MSRA's outputs: RAL Table 2's w/o L_PM
    {"losses.ral_da.weight": 0},
    {"plugins.ral.msra": False, "losses.ral_da.weight": 0, "losses.ral_pm.weight": 0},  # CSA only: no training outputs
])
def test_a_plugin_whose_outputs_some_loss_reads_or_that_has_none_is_accepted(overrides):
    cfg = load_config(RAL, overrides)
    assert "ral" in cfg.plugins


def test_ice_tcp_without_its_loss_term_is_refused_while_the_other_parts_are_read():
    ice = REPO / "configs" / "gmmformer_ice_synth.yaml"
    kept = {k: v for k, v in load_config(ice).to_dict()["losses"].items() if k != "ice_tcp"}
    with pytest.raises(ConfigError) as caught:
        load_config(ice, {"losses": kept})
    assert str(caught.value).endswith(
        "plugins.ice.tcp: no loss term reads its training outputs (tcp_logits, tcp_labels, tcp_part), "
        "so its parameters would train on nothing; add a loss term that reads them (loss: 'ice_tcp') or set plugins.ice.tcp: false")
    assert load_config(ice, {"losses": kept, "plugins.ice.tcp": False})


def test_arl_without_its_loss_and_cross_model_is_a_valid_diagnostic_run():
    cfg = load_config(REPO / "configs" / "arl_synth.yaml", {
        "plugins.arl.cross_model": False, "losses.ambiguity.weight": 0,
        "losses.base": {"loss": "triplet", "weight": 1.0, "branch": "frame"}})
    assert "arl" in cfg.plugins
