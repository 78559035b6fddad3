"""A study resumes from another copy of the project (``ray job submit`` unpacks the submitted folder
under a new path each time): the spec's hash counts the base config by its path from the spec, not
where the copy lies; a study recorded with the earlier hash (the absolute path) still resumes."""

from __future__ import annotations

import shutil

import yaml

from prvrlab.platform.cli import main
from prvrlab.platform.search.outcome import RunMap
from prvrlab.platform.search.spec import load_search_spec
from prvrlab.platform.search.study import record_state, spec_hash, study_root

from search_helpers import REPO, TINY_OVERRIDES


def _copy(tmp_path, tiny_root, where: str):
    """A copy of the project's base config and a spec naming it relatively (results and store shared)."""
    root = tmp_path / where
    (root / "configs").mkdir(parents=True)
    (root / "search_spaces").mkdir()
    shutil.copy(REPO / "configs" / "gmmformer_synth.yaml", root / "configs")
    spec = {
        "name": "moved",
        "base_config": "../configs/gmmformer_synth.yaml",
        "overrides": {**TINY_OVERRIDES, "data.root": str(tiny_root), "data.synthesize": None,
                      "tracking.uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "tracking.storage_path": str(tmp_path / "results")},
        "budget": {"trials": 2},
        "space": {"train.lr": {"loguniform": [3e-4, 3e-3]}},
    }
    path = root / "search_spaces" / "moved.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def _submission(tmp_path, recorded: str):
    study_dir = study_root(tmp_path / "results", "search", "moved") / "20250101-000000"
    (study_dir / "tune").mkdir(parents=True)
    (study_dir / "tune" / "experiment_state-1.json").write_text("{}")
    runs = RunMap(study_dir)
    runs.meta["spec_hash"] = recorded
    runs.save()
    record_state(study_dir)
    return study_dir


def test_the_hash_is_the_same_in_every_copy(tmp_path, tiny_root):
    first, second = (load_search_spec(_copy(tmp_path, tiny_root, w)) for w in ("a", "b"))
    assert first.base_config != second.base_config
    assert spec_hash(first) == spec_hash(second)
    assert spec_hash(first, absolute_base=True) != spec_hash(second, absolute_base=True)


def test_a_study_submitted_from_one_copy_resumes_from_another(tmp_path, tiny_root, capsys):
    submitted, again = _copy(tmp_path, tiny_root, "a"), _copy(tmp_path, tiny_root, "b")
    study_dir = _submission(tmp_path, spec_hash(load_search_spec(submitted)))
    assert main(["search", str(again), "--check", "--resume"]) == 0
    assert f"from {study_dir}" in capsys.readouterr().out


def test_a_study_recorded_with_the_absolute_hash_still_resumes(tmp_path, tiny_root, capsys):
    path = _copy(tmp_path, tiny_root, "a")
    study_dir = _submission(tmp_path, spec_hash(load_search_spec(path), absolute_base=True))
    assert main(["search", str(path), "--check", "--resume"]) == 0
    assert f"from {study_dir}" in capsys.readouterr().out
    other = _copy(tmp_path, tiny_root, "b")  # the absolute hash of another copy is another spec's
    (study_dir / "study.json").unlink()
    runs = RunMap(study_dir)
    runs.meta["spec_hash"] = spec_hash(load_search_spec(other), absolute_base=True)
    runs.save()
    assert main(["search", str(path), "--check", "--resume"]) == 2
    assert "was run with a different 'moved' spec" in capsys.readouterr().err
