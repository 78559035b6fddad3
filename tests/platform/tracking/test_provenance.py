"""Provenance under `ray job submit`: project-relative spec paths and the submitted commit."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

from prvrlab.platform.runtime import project_relative
from prvrlab.platform.search.outcome import RunMap
from prvrlab.platform.search.spec import load_search_spec
from prvrlab.platform.search.study import open_parent
from prvrlab.platform.tracking.store import Tracker, git_commit
from prvrlab.platform.tracking.tags import provenance_tags

REPO = Path(__file__).resolve().parents[3]


def test_paths_are_recorded_relative_to_the_working_dir_then_the_project(tmp_path, monkeypatch):
    job_copy, home, elsewhere = tmp_path / "runtime_resources" / "_ray_pkg_1", tmp_path / "home", tmp_path / "x"
    job_copy.mkdir(parents=True)
    monkeypatch.chdir(job_copy)
    monkeypatch.setenv("PRVRLAB_HOME", str(home))
    assert project_relative(job_copy / "specs" / "a.yaml") == "specs/a.yaml"
    assert project_relative(home / "search_spaces" / "b.yaml") == "search_spaces/b.yaml"
    assert project_relative(elsewhere / "c.yaml") == str(elsewhere / "c.yaml")
    assert project_relative("configs/../configs/d.yaml") == "configs/d.yaml"  # relative input: from the working dir


def test_the_submitted_commit_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("PRVRLAB_GIT_COMMIT", raising=False)
    assert git_commit(cwd=tmp_path) == "unknown"  # no .git here, as in Ray's copy of the working dir
    monkeypatch.setenv("PRVRLAB_GIT_COMMIT", "0123abcd-dirty")
    assert git_commit(cwd=tmp_path) == "0123abcd-dirty"
    assert provenance_tags("0123abcd-dirty") == {"git_commit": "0123abcd-dirty", "prvrlab.git_dirty": "true"}
    assert provenance_tags("0123abcd")["prvrlab.git_dirty"] == "false"
    assert provenance_tags("unknown")["prvrlab.git_dirty"] == "unknown"


def test_git_commit_reads_the_repository_when_not_given(monkeypatch):
    monkeypatch.delenv("PRVRLAB_GIT_COMMIT", raising=False)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    assert git_commit(cwd=REPO).split("-")[0] == head


def test_a_study_submitted_from_a_copy_records_project_paths_and_the_given_commit(tiny_root, tmp_path, monkeypatch):
    copy = tmp_path / "runtime_resources" / "working_dir_files" / "_ray_pkg_0123"
    (copy / "configs").mkdir(parents=True)
    (copy / "search_spaces").mkdir()
    shutil.copy(REPO / "configs" / "gmmformer_synth.yaml", copy / "configs" / "gmmformer_synth.yaml")
    spec = yaml.safe_load((REPO / "search_spaces" / "gmmformer_synth_tiny.yaml").read_text())
    spec["base_config"] = "configs/gmmformer_synth.yaml"
    (copy / "search_spaces" / "tiny.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    monkeypatch.chdir(copy)
    monkeypatch.setenv("PRVRLAB_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PRVRLAB_GIT_COMMIT", "feedbeef")
    loaded = load_search_spec(copy / "search_spaces" / "tiny.yaml", {"data.root": str(tiny_root)})
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "provenance")
    study_dir = tmp_path / "study"
    run_id = open_parent(tracker, RunMap(study_dir), loaded, "search", study_dir)
    run = tracker.client.get_run(run_id)
    assert run.data.params["spec.base_config"] == "configs/gmmformer_synth.yaml"
    assert run.data.tags["prvrlab.spec"] == "search_spaces/tiny.yaml"
    assert run.data.tags["git_commit"] == "feedbeef" and run.data.tags["prvrlab.git_dirty"] == "false"
    assert RunMap(study_dir).meta["spec"] == "search_spaces/tiny.yaml"


def test_an_ablation_submitted_again_after_its_spec_grew_records_the_new_spec_on_its_parent(tiny_root, tmp_path):
    """The parent run is reused (finished cells are skipped); the report reads the logged spec, so the
    spec as submitted now must replace it, and its new variants be logged as params."""
    from prvrlab.platform.search.spec import load_ablation_spec
    from prvrlab.reports.source import _spec_artifact

    spec = yaml.safe_load((REPO / "search_spaces" / "ablation_gmmformer_synth_tiny.yaml").read_text())
    spec["base_config"] = str(REPO / "configs" / "gmmformer_synth.yaml")
    path = tmp_path / "ablation.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "provenance")
    first = open_parent(tracker, RunMap(tmp_path / "s1"), load_ablation_spec(path, {"data.root": str(tiny_root)}),
                        "ablation", tmp_path / "s1")
    tracker.end_run(first, "FINISHED")
    grown = {**spec, "variants": {**spec["variants"], "no_clip_nce": {"losses.clip_nce.weight": 0}}, "seeds": [0, 1, 2]}
    path.write_text(yaml.safe_dump(grown, sort_keys=False))
    again = open_parent(tracker, RunMap(tmp_path / "s2"), load_ablation_spec(path, {"data.root": str(tiny_root)}),
                        "ablation", tmp_path / "s2", parent_run_id=first)
    assert again == first
    logged = _spec_artifact(tracker.client, first)
    assert logged["seeds"] == [0, 1, 2] and list(logged["variants"]) == ["full", "no_query_diverse", "no_clip_nce"]
    params = tracker.client.get_run(first).data.params
    assert "variant.no_clip_nce" in params and params["spec.seeds"] == "[0, 1]"  # a param keeps its first value
    tracker.end_run(first, "FINISHED")
