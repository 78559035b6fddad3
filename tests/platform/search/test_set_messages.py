"""``prvrlab search SPEC --set`` with a key it cannot take: one message, its prefix once (it read
'--set budget.trials: --set budget.trials: unknown key'), and a spec's own key named as one."""

from __future__ import annotations

from pathlib import Path

import pytest

from prvrlab.platform.config import ConfigError
from prvrlab.platform.search.spec import load_search_spec

SPEC = Path(__file__).resolve().parents[3] / "search_spaces" / "gmmformer_synth_tiny.yaml"


def message(overrides: dict) -> str:
    with pytest.raises(ConfigError) as info:
        load_search_spec(SPEC, overrides)
    return str(info.value)


def test_a_spec_key_is_named_as_one():
    text = message({"budget.trials": 5})
    assert text == "--set budget.trials: 'budget' is a key of the spec file, not of the config: set it in the spec"


def test_an_unknown_key_has_its_prefix_once():
    text = message({"foo.bar": 1})
    assert text.startswith("--set foo.bar: ") and text.count("--set foo.bar") == 1, text
    assert "did you mean 'train.lr'" in message({"trian.lr": 1})
