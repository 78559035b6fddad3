"""Config error messages: the key they name and the closest valid value they suggest."""

import pytest

from prvrlab.platform.config import ConfigError, apply_overrides, validate
from prvrlab.registry import LOSSES


def base() -> dict:
    return {
        "name": "t",
        "model": {"name": "gmmformer", "hidden_size": 32},
        "losses": {
            "clip_triplet": {"loss": "triplet", "weight": 1.0, "branch": "clip", "margin": 0.1},
            "clip_nce": {"loss": "infonce", "weight": 0.02, "branch": "clip"},
        },
        "train": {"epochs": 2},
    }


def error(raw: dict) -> str:
    with pytest.raises(ConfigError) as err:
        validate(raw)
    return str(err.value)


@pytest.mark.parametrize("override", [{"losses.clip_nec.weight": 0.1}, {"losses.clip_nec": {"weight": 0.5}}])
def test_a_misspelt_term_without_loss_names_the_term_and_the_closest_term(override):
    message = error(apply_overrides(base(), override))
    assert message.startswith("losses.clip_nec: unknown loss 'clip_nec' (did you mean 'clip_nce'?)")
    assert "losses.clip_nec.loss" not in message
    assert message.endswith(f"registered losses: {', '.join(LOSSES.names())}")


def test_a_term_without_loss_may_suggest_a_registered_loss():
    message = error(apply_overrides(base(), {"losses.infonc.weight": 0.1}))
    assert message.startswith("losses.infonc: unknown loss 'infonc' (did you mean 'infonce'?)")


def test_an_explicit_unknown_loss_still_names_the_loss_key_with_the_closest():
    message = error(apply_overrides(base(), {"losses.clip_nce.loss": "infonc"}))
    assert message.startswith("losses.clip_nce.loss: unknown loss 'infonc' (did you mean 'infonce'?)")
