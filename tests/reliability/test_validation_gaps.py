"""Issue 11, item 6: values and files that used to pass validation silently."""

from __future__ import annotations


import pytest
import yaml

from prvrlab.data.errors import DataError
from prvrlab.data.text import read_captions
from prvrlab.platform.cli import EXIT_BAD_INPUT, main
from prvrlab.platform.config import ConfigError, load_raw, validate
from prvrlab.platform.search.spec import load_search_spec

from search_helpers import tiny_spec
from train_helpers import small_raw


@pytest.mark.parametrize("weight", [float("inf"), ".inf", "-.inf"])
def test_infinite_loss_weight_is_rejected(tiny_root, tmp_path, weight):
    raw = small_raw(tiny_root, tmp_path)
    raw["losses"]["clip_nce"]["weight"] = yaml.safe_load(weight) if isinstance(weight, str) else weight
    with pytest.raises(ConfigError, match=r"losses\.clip_nce\.weight.*finite"):
        validate(raw)


def test_unknown_final_split_is_rejected_with_closest(tiny_root, tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(small_raw(tiny_root, tmp_path)))
    assert main(["train", str(cfg), "--set", "eval.final_splits=[val, tset]", "--check"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "eval.final_splits" in err and "'tset'" in err and "did you mean 'test'?" in err


def test_final_split_follows_renamed_data_splits(tiny_root, tmp_path):
    raw = small_raw(tiny_root, tmp_path)
    raw["eval"]["final_splits"] = ["val"]
    raw["data"]["test_split"] = None
    assert validate(raw).eval.final_splits == ["val"]
    raw["eval"]["final_splits"] = ["val", "test"]
    with pytest.raises(ConfigError, match=r"eval\.final_splits\[1\]: 'test'"):
        validate(raw)


def test_duplicate_key_in_config_names_file_key_and_line(tiny_root, tmp_path):
    cfg = tmp_path / "dup.yaml"
    text = yaml.safe_dump(small_raw(tiny_root, tmp_path), sort_keys=False)
    cfg.write_text(text + "name: other\n")
    line = text.count("\n") + 1
    with pytest.raises(ConfigError) as info:
        load_raw(cfg)
    msg = str(info.value)
    assert str(cfg) in msg and "'name'" in msg and f"line {line}" in msg


def test_duplicate_nested_key_is_rejected(tmp_path):
    cfg = tmp_path / "dup.yaml"
    cfg.write_text("name: a\ntrain:\n  lr: 0.1\n  epochs: 2\n  lr: 0.2\n")
    with pytest.raises(ConfigError, match=r"line 5, column 3: duplicate key 'lr' \(first at line 3\)"):
        load_raw(cfg)


def test_duplicate_key_in_search_spec(tiny_root, tmp_path):
    spec = tiny_spec(tmp_path, tiny_root)
    spec.write_text(spec.read_text() + "concurrency: 2\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'concurrency'") as info:
        load_search_spec(spec)
    assert str(spec) in str(info.value)


def test_non_utf8_caption_names_file_and_line(tmp_path):
    path = tmp_path / "synthtrain.caption.txt"
    path.write_bytes(b"v1#0 a person walks\nv1#1 caf\xe9 scene\n")
    with pytest.raises(DataError) as info:
        read_captions(path)
    msg = str(info.value)
    assert str(path) in msg and "line 2" in msg and "UTF-8" in msg


def test_utf8_captions_still_read(tmp_path):
    path = tmp_path / "synthtrain.caption.txt"
    path.write_text("v1#0 café scene\n\nv1#1 b\n", encoding="utf-8")
    assert read_captions(path) == [("v1#0", "café scene"), ("v1#1", "b")]


def test_default_final_splits_are_the_data_sections_validation_and_test_splits(tiny_root, tmp_path):
    """The resolved config had shown final_splits [val, test] with test_split null (the test was skipped at run
    time), and a data section naming its validation split 'dev' had no final validation metrics."""
    raw = small_raw(tiny_root, tmp_path)
    raw["eval"] = {}
    assert validate(raw).eval.final_splits == ["val", "test"]
    raw["data"]["test_split"] = None
    assert validate(raw).eval.final_splits == ["val"]
    raw["data"].update(val_split="dev", test_split="test")
    assert validate(raw).eval.final_splits == ["dev", "test"]
    raw["eval"] = {"final_splits": ["test"]}  # given: kept as given
    assert validate(raw).eval.final_splits == ["test"]
