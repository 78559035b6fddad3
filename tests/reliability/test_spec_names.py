"""Issue 11, item 9 (part): a study name is one safe path component."""

from __future__ import annotations

import pytest

from prvrlab.platform.config import ConfigError
from prvrlab.platform.search.spec import load_ablation_spec, load_search_spec

from search_helpers import tiny_spec


@pytest.mark.parametrize("name", ["..", ".", "a b", "x\\y", "ü"])
def test_unsafe_search_name_is_rejected(tiny_root, tmp_path, name):
    spec = tiny_spec(tmp_path, tiny_root, name="spec")
    spec.write_text(spec.read_text().replace("name: spec", f"name: '{name}'", 1))
    with pytest.raises(ConfigError, match=r"name: .*letters, digits"):
        load_search_spec(spec)


def test_unsafe_ablation_name_is_rejected(tiny_root, tmp_path):
    spec = tiny_spec(tmp_path, tiny_root, name="spec", variants={"a": {"train.lr": 0.001}})
    spec.write_text(spec.read_text().replace("name: spec", "name: '..'", 1))
    with pytest.raises(ConfigError, match=r"name: '\.\.'"):
        load_ablation_spec(spec)


def test_safe_name_is_kept(tiny_root, tmp_path):
    spec = tiny_spec(tmp_path, tiny_root, name="spec")
    spec.write_text(spec.read_text().replace("name: spec", "name: lr-sweep_v1.2", 1))
    assert load_search_spec(spec).name == "lr-sweep_v1.2"
