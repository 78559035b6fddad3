"""Values no run could use are one ConfigError naming the key, at validation: keys YAML reads as numbers,
booleans or null, integers past 64 bits, sizes torch cannot build, layer counts that would build for hours
(each had been a traceback, an error inside a recorded run, or a check eating the machine's memory)."""

from __future__ import annotations

import pytest
import yaml

from prvrlab.checks import MAX_LAYERS, first_line
from prvrlab.platform.config import MAX_PARAMETERS, ConfigError, apply_overrides, validate

from config_helpers import base


def error(raw: dict) -> str:
    with pytest.raises(ConfigError) as err:
        validate(raw)
    assert "\n" not in str(err.value)
    return str(err.value)


@pytest.mark.parametrize(
    "text, where",
    [
        ("1: x", "the config"),
        ("train: {1: 2}", "train"),
        ("train: {~: 3}", "train"),
        ("data: {no: 1}", "data"),  # YAML 1.1: no is false
        ("model: {name: gmmformer, 1: 2}", "model"),
        ("losses: {clip_nce: {loss: infonce, 1: 2}}", "losses.clip_nce"),
        ("losses: {~: {loss: infonce}}", "losses"),
        ("plugins: {on: {}}", "plugins"),
    ],
)
def test_a_key_yaml_reads_as_a_value_is_named_with_its_type(text, where):
    extra = yaml.safe_load(text)
    raw = base()
    for section, value in extra.items():
        if isinstance(value, dict) and isinstance(raw.get(section), dict):
            raw[section] = {**raw[section], **value}
        else:
            raw[section] = value
    key = next(k for k in (extra if where == "the config" else _inner(extra)) if not isinstance(k, str))
    message = error(raw)
    assert message.startswith(f"{where}: the key {key!r} is read as {type(key).__name__}, not as a name")


def _inner(extra: dict) -> dict:
    """The innermost mapping of a one-key-per-level snippet that holds the non-string key."""
    value = next(iter(extra.values()))
    while isinstance(value, dict) and all(isinstance(k, str) for k in value):
        value = next(v for v in value.values() if isinstance(v, dict))
    return value


@pytest.mark.parametrize(
    "key, value",
    [("train.torch_threads", 10**20), ("data.num_clips", 10**20), ("train.epochs", 2**64), ("model.hidden_size", -(2**63) - 1)],
)
def test_integers_past_64_bits_are_refused_naming_the_key(key, value):
    assert error(apply_overrides(base(), {key: value})).startswith(key)


@pytest.mark.parametrize("key", ["data.max_frames", "data.num_clips", "data.max_query_len"])
def test_lengths_past_a_million_are_refused(key):
    assert f"{key} must be at most {1 << 20}" in error(apply_overrides(base(), {key: (1 << 20) + 1}))
    model = {} if key == "data.num_clips" else {f"model.{key.split('.')[1]}": 1 << 10}  # the backbone's table holds it
    validate(apply_overrides(base(), {key: 1 << 10, **model}))


def test_a_negative_synthetic_seed_is_refused_at_validation():
    assert "data.synth_seed must be an integer >= 0, got -1" in error(apply_overrides(base(), {"data.synth_seed": -1}))


def test_layer_counts_past_the_limit_are_refused_before_building():
    message = error(apply_overrides(base(), {"model.num_gmm_blocks": 10**18}))
    assert message == f"model: num_gmm_blocks must be at most {MAX_LAYERS} layers, got {10**18}"
    validate(apply_overrides(base(), {"model.num_gmm_blocks": 3}))


def test_sizes_torch_cannot_build_or_no_machine_holds_are_one_line_naming_the_model():
    overflow = error(apply_overrides(base(), {"model.hidden_size": 2**62}))
    assert overflow.startswith("model: ") and "frame #" not in overflow
    hidden = 1 << 17  # buildable on the meta device, ~10^11 parameters
    huge = error(apply_overrides(base(), {"model.hidden_size": hidden, "model.num_heads": 1}))
    assert huge.startswith("model: ") and f"more than {MAX_PARAMETERS:.3g}" in huge


def test_first_line_is_an_errors_first_non_empty_line_or_its_type():
    assert first_line(RuntimeError("\n  overflowed\nframe #0: c10::Error")) == "overflowed"
    assert first_line(ValueError()) == "ValueError"
