"""'did you mean' for dotted keys (``--set``, a spec's space and variants): the last part is matched against the
keys under the same prefix, so a shared ``train.`` alone never names an unrelated key."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from prvrlab.platform.config import SECTIONS, ConfigError, load_config
from prvrlab.platform.search.spec import load_search_spec
from prvrlab.registry import closest_key

from train_helpers import small_raw

REPO = Path(__file__).resolve().parents[2]
TRAIN = [f"train.{f.name}" for f in dataclasses.fields(SECTIONS["train"])]


@pytest.mark.parametrize(
    "key, expected",
    [
        ("train.lrr", "train.lr"),
        ("train.epoch", "train.epochs"),
        ("train.batch", "train.batch_size"),  # begins the key: before the closer-scoring ddp_batch
        ("trian.lr", "train.lr"),  # no candidate under 'trian': the whole key
        ("train.learning_rate", None),  # only 'train.' in common: nothing
    ],
)
def test_closest_key(key, expected):
    assert closest_key(key, TRAIN + ["model.hidden_size"]) == expected


def test_an_unrelated_key_under_a_shared_prefix_gets_no_hint_by_set():
    with pytest.raises(ConfigError) as err:
        load_config(REPO / "configs" / "gmmformer_synth.yaml", overrides={"train.learning_rate": 1e-3})
    message = str(err.value)
    assert message.startswith("--set train.learning_rate: unknown key; valid keys in train: ")
    assert "did you mean" not in message and ", lr," in message


def _spec(tmp_path: Path, tiny_root: Path, space: dict) -> Path:
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump(small_raw(tiny_root, tmp_path)))
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({"name": "s", "base_config": "base.yaml", "space": space}))
    return spec


def test_a_spec_key_with_nothing_close_lists_the_keys_of_its_section(tmp_path, tiny_root):
    with pytest.raises(ConfigError) as err:
        load_search_spec(_spec(tmp_path, tiny_root, {"train.learning_rate": {"loguniform": [1e-4, 1e-3]}}))
    message = str(err.value)
    assert "space: unknown config key 'train.learning_rate'; keys in train: " in message
    listed = message.split("keys in train: ", 1)[1].split(", ")
    assert "lr" in listed and "clip_grad" in listed and "did you mean" not in message


def test_a_spec_key_close_to_one_of_its_section_names_it_in_full(tmp_path, tiny_root):
    with pytest.raises(ConfigError, match=r"unknown config key 'train\.weight_decy' \(did you mean 'train\.weight_decay'\?\)$"):
        load_search_spec(_spec(tmp_path, tiny_root, {"train.weight_decy": {"loguniform": [1e-4, 1e-3]}}))
