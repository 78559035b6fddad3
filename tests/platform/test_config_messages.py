"""Config error messages: the key they name and the closest valid value they suggest."""

from pathlib import Path

import pytest
import yaml

from prvrlab.data.synth import PRESETS, get_preset
from prvrlab.platform.config import ConfigError, apply_overrides, load_config, validate
from prvrlab.platform.search.spec import load_ablation_spec, load_search_spec
from prvrlab.registry import BACKBONES, LOSSES

from config_helpers import base


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


def write(path: Path, raw: dict) -> Path:
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def load_error(path: Path, overrides: dict) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(path, overrides)
    return str(err.value)


@pytest.mark.parametrize(
    "key, value",
    [
        ("train.epochs", 0),
        ("train.lr", -0.1),
        ("model.dropout", 1.5),
        ("model.num_heads", 3),
        ("losses.clip_nce.weight", -1),
        ("losses.clip_nec.weight", 0.1),
        ("plugins.ral.num_proxies", 0),
        ("plugins.rall.msra", True),
        ("plugins.ral.msrx", True),
    ],
)
def test_an_error_in_a_set_value_names_the_set_key_not_the_file(tmp_path, key, value):
    path = write(tmp_path / "c.yaml", base())
    plain = error(apply_overrides(base(), {key: value}))
    assert load_error(path, {key: value}) == f"--set {key}: {plain.removeprefix(key).lstrip(': ')}"  # the key once


def test_an_error_in_the_file_names_the_file_beside_a_set_key_of_the_same_section(tmp_path):
    path = write(tmp_path / "c.yaml", apply_overrides(base(), {"model.dropout": 1.5}))
    assert load_error(path, {"model.num_heads": 4}).startswith(f"{path}: model: dropout must be")


def test_search_set_errors_name_the_set_key_not_the_spec(tmp_path):
    write(tmp_path / "base.yaml", base())
    spec = write(tmp_path / "spec.yaml", {"name": "s", "base_config": "base.yaml", "overrides": {"train.epochs": 1},
                                          "space": {"train.lr": {"loguniform": [1e-4, 1e-2]}}})
    with pytest.raises(ConfigError, match=r"^--set train\.lrr: unknown config key 'train\.lrr' \(did you mean 'train\.lr'\?\)$"):
        load_search_spec(spec, {"train.lrr": 1})
    with pytest.raises(ConfigError, match=r"^--set train\.epochs: must be a finite number > 0, got 0$"):
        load_search_spec(spec, {"train.epochs": 0})
    with pytest.raises(ConfigError, match=r"spec\.yaml: overrides: train\.epochs must be a finite number > 0, got 0$"):
        load_search_spec(write(spec, {**yaml.safe_load(spec.read_text()), "overrides": {"train.epochs": 0}}), {"train.lr": 1e-3})


@pytest.mark.parametrize("preset, closest", [("tinyy", "tiny"), ("small-skewd", "small-skewed")])
def test_an_unknown_synthetic_preset_names_the_key_and_the_closest(preset, closest):
    message = error(apply_overrides(base(), {"data.synthesize": preset}))
    assert message.startswith(f"data.synthesize: unknown synthetic preset '{preset}' (did you mean '{closest}'?)")
    assert get_preset(closest).name == closest


@pytest.mark.parametrize("preset", [*PRESETS, *(f"{name}-skewed" for name in PRESETS if name != "skewed")])
def test_every_synthetic_preset_validates(preset):
    assert validate(apply_overrides(base(), {"data.synthesize": preset})).data.synthesize == preset


def test_a_plugin_typo_in_an_ablation_variant_gets_the_suggestion_train_gives(tmp_path):
    write(tmp_path / "base.yaml", base())
    spec = write(tmp_path / "abl.yaml", {"name": "a", "base_config": "base.yaml",
                                         "variants": {"full": {}, "typo": {"plugins.rall.msra": False}}})
    plain = error(apply_overrides(base(), {"plugins.rall.msra": False}))
    assert "plugins.rall: unknown plugin 'rall' (did you mean 'ral'?)" in plain
    with pytest.raises(ConfigError) as err:
        load_ablation_spec(spec)
    assert str(err.value) == f"{spec}: variants.typo: {plain}"


@pytest.mark.parametrize("key, value", [("extends", "x.yaml"), ("unset", ["train.lr"])])
def test_extends_and_unset_cannot_be_set_with_set_in_one_plain_message(tmp_path, key, value):
    path = write(tmp_path / "c.yaml", base())
    assert load_error(path, {key: value}) == f"--set {key}: {key} cannot be set with --set; put it in the YAML file"
    spec = write(tmp_path / "spec.yaml", {"name": "s", "base_config": "c.yaml",
                                          "space": {"train.lr": {"loguniform": [1e-4, 1e-2]}}})
    with pytest.raises(ConfigError) as err:
        load_search_spec(spec, {key: value})
    assert str(err.value).startswith(f"--set {key}: ") and "put them in the YAML file" in str(err.value)
    assert "load_config" not in str(err.value) and "load_raw" not in str(err.value)


@pytest.mark.parametrize(
    "section, value, example",
    [
        ("model", "gmmformer", "{name: gmmformer}"),
        ("model", [1], "{name: " + BACKBONES.names()[0] + "}"),
        ("losses", 3, "{<term>: {loss: <loss>, weight: 1.0}}"),
        ("plugins", "ral", "{<plugin>: {<param>: <value>}}"),
        ("train", 5, "{epochs: ...}"),
    ],
)
def test_a_section_that_is_no_mapping_says_so(tmp_path, section, value, example):
    expected = f"{section} must be a mapping (e.g. {section}: {example}), got {value!r}"
    assert error({**base(), section: value}) == expected
    assert load_error(write(tmp_path / "c.yaml", base()), {section: value}) == f"--set {section}: {expected.removeprefix(section + ' ')}"


@pytest.mark.parametrize("loader", [load_search_spec, load_ablation_spec])
def test_an_experiment_config_given_as_a_spec_is_pointed_to_train(tmp_path, loader):
    write(tmp_path / "parent.yaml", base())
    path = write(tmp_path / "c.yaml", {"extends": "parent.yaml", "train": {"epochs": 1}})
    with pytest.raises(ConfigError) as err:
        loader(path)
    assert str(err.value).startswith(f"{path}: this looks like an experiment config (extends, train), not a spec; "
                                     f"train it with 'prvrlab train {path}'")


def test_a_spec_of_the_other_kind_is_pointed_to_its_command(tmp_path):
    write(tmp_path / "base.yaml", base())
    search = write(tmp_path / "s.yaml", {"name": "s", "base_config": "base.yaml", "space": {"train.lr": {"loguniform": [1e-4, 1e-2]}}})
    ablation = write(tmp_path / "a.yaml", {"name": "a", "base_config": "base.yaml", "variants": {"full": {}}})
    with pytest.raises(ConfigError) as err:
        load_ablation_spec(search)
    assert str(err.value) == f"{search}: this is a spec for 'prvrlab search' (it has 'space'); run it with 'prvrlab search {search}'"
    with pytest.raises(ConfigError) as err:
        load_search_spec(ablation)
    assert str(err.value) == f"{ablation}: this is a spec for 'prvrlab ablate' (it has 'variants'); run it with 'prvrlab ablate {ablation}'"
    assert load_search_spec(search).name == "s" and load_ablation_spec(ablation).name == "a"


def test_a_loss_reading_an_output_an_enabled_plug_in_switched_off_says_so():
    """It had said 'enable it under plugins.ral (enabled: ral)'."""
    raw = apply_overrides(base(), {"plugins": {"ral": {"msra": False, "csa": True}}, "losses.da": {"loss": "ral_da", "weight": 0.1}})
    message = error(raw)
    assert "which plugins.ral does not produce with its parameters (a part of it switched off?)" in message
    assert "enable it under" not in message
    assert "which no enabled plug-in produces; enable it under plugins.ral (enabled: none)" in error(
        apply_overrides(base(), {"losses.da": {"loss": "ral_da", "weight": 0.1}}))
