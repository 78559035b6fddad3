"""A search over a key its component reads only under another value of a key beside it
(``Component.applies_when``) is refused while that key is fixed elsewhere, or searched without a ``when``."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from prvrlab.models.component import Component
from prvrlab.platform.config import ConfigError
from prvrlab.platform.search.spec import load_search_spec
from prvrlab.registry import LOSSES, PLUGINS

REPO = Path(__file__).resolve().parents[3]


def _spec(tmp_path: Path, base: str, space: dict, overrides: dict | None = None) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({
        "name": "s", "base_config": str(REPO / "configs" / base), "space": space,
        "overrides": {"tracking.uri": f"sqlite:///{tmp_path / 'm.db'}", **(overrides or {})},
    }, sort_keys=False))
    return path


def test_ral_tau_under_the_official_formulation_is_refused_naming_the_switch(tmp_path):
    path = _spec(tmp_path, "gmmformer_v2_ral_tvr.yaml", {"losses.ral_pm.tau": {"loguniform": [0.02, 0.5]}})
    with pytest.raises(ConfigError) as err:
        load_search_spec(path)
    assert str(err.value) == (
        f"{path}: space.losses.ral_pm.tau: has no effect: it acts only when losses.ral_pm.formulation is 'paper', "
        "and losses.ral_pm.formulation is 'official' in every trial; set losses.ral_pm.formulation: 'paper' in the "
        "spec's overrides, or leave the key out"
    )
    fixed = _spec(tmp_path, "gmmformer_v2_ral_tvr.yaml", {"losses.ral_pm.tau": {"loguniform": [0.02, 0.5]}},
                  {"losses.ral_pm.formulation": "paper"})
    assert [p.key for p in load_search_spec(fixed).space] == ["losses.ral_pm.tau"]


def test_a_threshold_searched_beside_its_mode_needs_a_when_on_it(tmp_path):
    space = {"plugins.arl.tau_s_mode": {"choice": ["rule", "fixed"]}, "plugins.arl.tau_s": {"uniform": [0.2, 0.9]}}
    with pytest.raises(ConfigError, match=r"space\.plugins\.arl\.tau_s: acts only when plugins\.arl\.tau_s_mode is "
                                          r"'fixed', which is searched too; give it when: \{plugins\.arl\.tau_s_mode: 'fixed'\}"):
        load_search_spec(_spec(tmp_path, "arl_synth.yaml", space))
    space["plugins.arl.tau_s"]["when"] = {"plugins.arl.tau_s_mode": "rule"}  # drawn only where nothing reads it
    with pytest.raises(ConfigError, match=r"give it when: \{plugins\.arl\.tau_s_mode: 'fixed'\}"):
        load_search_spec(_spec(tmp_path, "arl_synth.yaml", space))
    space["plugins.arl.tau_s"]["when"] = {"plugins.arl.tau_s_mode": "fixed"}
    assert len(load_search_spec(_spec(tmp_path, "arl_synth.yaml", space)).space) == 2
    with pytest.raises(ConfigError, match=r"plugins\.arl\.tau_u_mode is 'rule' in every trial"):
        load_search_spec(_spec(tmp_path, "arl_synth.yaml", {"plugins.arl.tau_u": {"uniform": [0.0, 0.5]}}))


def test_every_declared_rule_names_parameters_of_its_own_component():
    """applies_when names real constructor parameters and values the switch accepts (a typo would disable a check)."""
    import typing

    declared = 0
    for registry in (LOSSES, PLUGINS):
        for name in registry.names():
            rules = getattr(registry.get(name), "applies_when", {})
            params = registry.params(name)
            for param, conditions in rules.items():
                assert param in params, (name, param)
                for other, values in conditions.items():
                    assert other in params and values, (name, other)
                    allowed = typing.get_args(params[other].annotation)
                    assert not allowed or set(values) <= set(allowed), (name, other, values, allowed)
                    declared += 1
    assert declared >= 4 and Component.applies_when == {}
