"""An ablation's parent run ends FAILED, with the error, whatever fails once it is open (it was left RUNNING,
then closed KILLED as if its driver had died); and a variant name whose per-cell tag key MLflow refuses is
refused by the spec check, before anything is recorded."""

from __future__ import annotations

import pytest

from prvrlab.platform.config import ConfigError, mlflow_key_problem
from prvrlab.platform.search.ablation import ablate
from prvrlab.platform.search.spec import CELL_HASH_TAG, load_ablation_spec
from prvrlab.platform.tracking.store import Tracker

from search_helpers import study_runs, tiny_spec


def _longest_name(prefix: str, fits) -> str:
    """The longest name ``prefix`` + 'v'*n that ``fits``."""
    name = prefix
    while fits(name + "v"):
        name += "v"
    return name


def test_a_variant_whose_cell_tag_key_is_too_long_is_refused_by_the_check(tiny_root, tmp_path):
    # longest name whose parent param and metric keys fit: its cell tag key is 11+ characters longer
    name = _longest_name("v", lambda n: not mlflow_key_problem(f"variant.{n}") and not mlflow_key_problem(f"variant/{n}/mean"))
    assert mlflow_key_problem(f"{CELL_HASH_TAG}{name}/seed0")  # the case the param and metric checks let through
    path = tiny_spec(tmp_path, tiny_root, name="long", variants={name: {}}, seeds=[0])
    with pytest.raises(ConfigError) as caught:
        load_ablation_spec(path)
    assert f"variants.{name}" in str(caught.value) and f"'{CELL_HASH_TAG}{name}/seed0'" in str(caught.value)


def test_a_name_that_fits_with_its_longest_seed_passes(tiny_root, tmp_path):
    name = _longest_name("v", lambda n: not mlflow_key_problem(f"{CELL_HASH_TAG}{n}/seed12"))
    path = tiny_spec(tmp_path, tiny_root, name="fits", variants={name: {}}, seeds=[3, 12])
    assert list(load_ablation_spec(path).variants) == [name]
    too_long = tiny_spec(tmp_path, tiny_root, name="seed", variants={name: {}}, seeds=[3, 123])
    with pytest.raises(ConfigError, match="seed123"):  # one more digit in one seed: that cell's key is too long
        load_ablation_spec(too_long)


def test_a_failure_right_after_the_parent_opens_ends_it_failed(tiny_root, tmp_path, monkeypatch):
    path = tiny_spec(tmp_path, tiny_root, name="gap", variants={"full": {}}, seeds=[0])
    plain = Tracker.set_tags

    def refusing(self, run_id, tags):
        if any(k.startswith(CELL_HASH_TAG) for k in tags):
            raise RuntimeError("the store refused the cell tags")
        return plain(self, run_id, tags)

    monkeypatch.setattr(Tracker, "set_tags", refusing)
    with pytest.raises(RuntimeError, match="refused the cell tags"):
        ablate(load_ablation_spec(path), echo=None)
    (parent,), children = study_runs(tmp_path)
    assert parent.info.status == "FAILED" and not children
    assert "refused the cell tags" in parent.data.tags["error"]
