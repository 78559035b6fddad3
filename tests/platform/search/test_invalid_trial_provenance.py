"""The child run of a trial whose sampled config does not validate carries the code's commit as its
sibling trials do (``git_commit``, ``prvrlab.git_dirty`` and MLflow's Version column)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import mlflow

from prvrlab.platform.search.mlflow_callback import MlflowStudyCallback
from prvrlab.platform.search.outcome import STUDY_FILE
from prvrlab.platform.search.study import StudyContext
from prvrlab.platform.tracking.store import Tracker, git_commit


def test_an_invalid_trial_records_the_commit(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    folder = tmp_path / "study"
    folder.mkdir()
    parent = Tracker(uri, "e").start_run("search")
    (folder / STUDY_FILE).write_text(json.dumps({"parent": parent, "trials": {}, "closed": {}}))
    study = StudyContext(kind="search", name="s", study_dir=str(folder), base_raw={}, metric="val/sumr", mode="max",
                         workers=1, cpus_per_worker=1.0, gpus_per_worker=0.0, tracking_uri=uri, experiment="e")
    trial = SimpleNamespace(trial_id="t", config={"train.lr": -1.0}, last_result={})
    run = mlflow.MlflowClient(uri).get_run(MlflowStudyCallback(study)._child_run(trial))
    tags = run.data.tags
    assert "train.lr" in tags["error"] or "model.name" in tags["error"]  # refused: the invalid-trial path
    commit = git_commit()
    assert tags["git_commit"] == commit
    assert tags["prvrlab.git_dirty"] == ("unknown" if commit == "unknown" else str(commit.endswith("-dirty")).lower())
    if commit != "unknown":
        assert tags["mlflow.source.git.commit"] == commit.removesuffix("-dirty")
