"""Run tags name a loss term's switched parts (``switch_params``) as plug-ins' parts are named, so an ablation
table over IRM's L_neg / L_red gets a column per part."""

from __future__ import annotations

from pathlib import Path

from prvrlab.platform.config import load_raw, loss_tokens, validate
from prvrlab.platform.search.study import _components

REPO = Path(__file__).resolve().parents[2]


def ice_raw() -> dict:
    return load_raw(REPO / "configs" / "ice_base_ice_synth.yaml")


def test_a_switched_loss_lists_its_parts_that_are_on():
    raw = ice_raw()
    terms = [t for t, s in validate(raw).losses.items() if s["weight"] > 0]
    tokens = loss_tokens(validate(raw))
    assert "ice_irm.neg" in tokens and "ice_irm.red" in tokens and "ice_irm" not in tokens
    assert [t for t in tokens if "." not in t] == [t for t in terms if t != "ice_irm"]  # the others by term name
    raw["losses"]["ice_irm"]["red"] = False
    tokens = loss_tokens(validate(raw))
    assert "ice_irm.neg" in tokens and "ice_irm.red" not in tokens
    raw["losses"]["ice_irm"]["neg"] = False
    assert not any(t.startswith("ice_irm") for t in loss_tokens(validate(raw)))


def test_a_term_of_weight_zero_is_not_listed():
    raw = ice_raw()
    raw["losses"]["ice_irm"]["weight"] = 0
    assert not any(t.startswith("ice_irm") for t in loss_tokens(validate(raw)))


def test_the_components_tag_carries_them():
    raw = ice_raw()
    raw["losses"]["ice_irm"]["neg"] = False
    parts = _components(validate(raw)).split(",")
    assert "loss:ice_irm.red" in parts and "loss:ice_irm.neg" not in parts and "loss:ice_irm" not in parts
    assert parts[0].startswith("backbone:")
