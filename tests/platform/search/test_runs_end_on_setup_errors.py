"""A study's parent or child run that fails while being set up (params, artifacts, run map) is ended
at once, FAILED (KILLED on an interrupt), never left RUNNING for the run sentinel to mislabel."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from mlflow.exceptions import MlflowException

from prvrlab.platform.search.mlflow_callback import MlflowStudyCallback
from prvrlab.platform.search.outcome import STUDY_FILE, RunMap
from prvrlab.platform.search.spec import load_ablation_spec
from prvrlab.platform.search.study import open_parent
from prvrlab.platform.storage import Mirror
from prvrlab.platform.tracking.store import Tracker

from search_helpers import tiny_spec


def _raises(error: BaseException):
    def call(*args, **kwargs):
        raise error

    return call


@pytest.fixture
def ablation(tiny_root, tmp_path):
    return load_ablation_spec(tiny_spec(tmp_path, tiny_root, variants={"full": {}}, seeds=[0]))


@pytest.mark.parametrize(
    "error, status", [(NotADirectoryError("artifact root is a file"), "FAILED"), (KeyboardInterrupt(), "KILLED")]
)
def test_a_new_parent_run_that_fails_while_being_opened_is_ended(ablation, tmp_path, monkeypatch, error, status):
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "tests")
    monkeypatch.setattr(tracker, "log_artifacts", _raises(error))
    with pytest.raises(type(error)):
        open_parent(tracker, RunMap(tmp_path / "study"), ablation, "ablation", tmp_path / "study")
    (run,) = tracker.client.search_runs([tracker.experiment_id])
    assert run.info.status == status and run.data.tags["prvrlab.kind"] == "ablation"
    assert ("error" in run.data.tags) == (status == "FAILED")
    assert str(error) in run.data.tags.get("error", str(error))


def test_a_reopened_parent_run_that_fails_while_being_opened_is_ended_failed(ablation, tmp_path, monkeypatch):
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "tests")
    first = open_parent(tracker, RunMap(tmp_path / "s1"), ablation, "ablation", tmp_path / "s1")
    tracker.end_run(first, "FINISHED")
    monkeypatch.setattr(tracker, "log_params", _raises(MlflowException("Invalid value for parameter 'params[0].name'")))
    with pytest.raises(MlflowException):
        open_parent(tracker, RunMap(tmp_path / "s2"), ablation, "ablation", tmp_path / "s2", parent_run_id=first)
    run = tracker.client.get_run(first)
    assert run.info.status == "FAILED" and "Invalid value" in run.data.tags["error"]


def _study(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    study_dir = tmp_path / "study"
    study = SimpleNamespace(
        study_dir=str(study_dir), tracking_uri=uri, experiment="setup", storage="",
        trial_dir=lambda t: study_dir / "trials" / t / "files", push_files=lambda: Mirror(study_dir, None),
        experiment_config=lambda config: SimpleNamespace(flat=lambda: {"train.lr": config["train.lr"]}),
        trial_tags=lambda config, cfg, commit: {"prvrlab.kind": "trial"},
        run_name=lambda number, config: f"trial {number}",
    )
    tracker = Tracker(uri, "setup")
    parent = tracker.start_run("search")
    study_dir.mkdir()
    (study_dir / STUDY_FILE).write_text(json.dumps({"parent": parent, "trials": {}, "closed": {}}))
    return study, tracker


@pytest.mark.parametrize(
    "error, status", [(MlflowException("Invalid value for parameter 'params[0].name'"), "FAILED"), (KeyboardInterrupt(), "KILLED")]
)
def test_a_child_run_whose_params_fail_is_ended_and_mapped(tmp_path, monkeypatch, error, status):
    study, tracker = _study(tmp_path)
    callback = MlflowStudyCallback(study)
    monkeypatch.setattr(callback.tracker, "log_params", _raises(error))
    trial = SimpleNamespace(trial_id="t1", config={"train.lr": 0.01})
    with pytest.raises(type(error)):
        callback.on_trial_start(0, [trial], trial)
    (child,) = [r for r in tracker.client.search_runs([tracker.experiment_id]) if r.info.run_name == "trial 1"]
    assert child.info.status == status
    assert ("error" in child.data.tags) == (status == "FAILED")
    saved = RunMap(study.study_dir)
    assert saved.trials == {"t1": child.info.run_id} and saved.closed == {"t1": status}


@pytest.mark.parametrize("kind", ["search", "ablation"])
def test_an_unexpected_error_in_the_driver_ends_the_parent_failed_with_its_line(tiny_root, tmp_path, monkeypatch, kind):
    """An error the study did not foresee (a bug, a broken environment) leaves its one line on the parent run,
    as a failed trial's run has, instead of a bare FAILED."""
    from prvrlab.platform.search import ablation as ablation_driver
    from prvrlab.platform.search import tuning
    from prvrlab.platform.search.spec import load_search_spec

    module = tuning if kind == "search" else ablation_driver
    monkeypatch.setattr(module, "prepare_environment", _raises(TypeError("'>' not supported between 'str' and 'int'")))
    if kind == "search":
        spec = load_search_spec(tiny_spec(tmp_path, tiny_root))
        run = lambda: tuning.search(spec, echo=None)  # noqa: E731
    else:
        spec = load_ablation_spec(tiny_spec(tmp_path, tiny_root, variants={"full": {}}, seeds=[0]))
        run = lambda: ablation_driver.ablate(spec, echo=None)  # noqa: E731
    with pytest.raises(TypeError):
        run()
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "tests")
    (parent,) = tracker.client.search_runs([tracker.experiment_id])
    assert parent.info.status == "FAILED" and parent.data.tags["prvrlab.status"] == "failed"
    assert "TypeError: '>' not supported" in parent.data.tags["error"]


def test_the_parent_run_records_the_overrides_as_applied_set_included(tiny_root, tmp_path):
    from prvrlab.platform.search.spec import load_search_spec

    spec = load_search_spec(tiny_spec(tmp_path, tiny_root), extra_overrides={"train.epochs": 3})
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "tests")
    parent = open_parent(tracker, RunMap(tmp_path / "study"), spec, "search", tmp_path / "study")
    logged = tracker.client.get_run(parent).data.params["spec.overrides"]
    assert "'train.epochs': 3" in logged and "'data.root'" in logged  # --set beside the file's own
    tracker.end_run(parent, "FINISHED")
