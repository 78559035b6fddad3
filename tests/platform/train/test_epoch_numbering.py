"""One epoch convention everywhere: counted from 1 (model files, reports; the console and MLflow side is
asserted on a real run by ``test_train.py::test_in_process_training_learns_and_is_recorded``)."""

from __future__ import annotations

import mlflow

from prvrlab.platform.tracking.store import Tracker
from prvrlab.platform.train.checkpoint_eval import checkpoint_epoch
from prvrlab.reports.source import Study, TrialRun


def test_model_files_written_before_format_3_counted_from_zero():
    assert checkpoint_epoch({"epoch": 0, "format": 2}) == 1
    assert checkpoint_epoch({"epoch": 4}) == 5  # format 1 had no "format" key
    assert checkpoint_epoch({"epoch": 4, "format": 3}) == 4
    assert checkpoint_epoch({"format": 3}) is None


def test_reports_read_old_zero_based_runs_and_new_runs_on_the_same_scale(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker(uri, "epochs")
    old = tracker.start_run("old", tags={})
    new = tracker.start_run("new", tags={"prvrlab.epoch_base": "1"})
    for step, value in [(0, 10.0), (1, 20.0)]:
        tracker.log_metrics(old, {"val/sumr": value}, step=step)
        tracker.log_metrics(new, {"val/sumr": value}, step=step + 1)
    client = mlflow.MlflowClient(tracking_uri=uri)
    study = Study(uri, "parent", "search", "s", tracker.experiment_id, {}, {}, {}, [], client=client)

    def trial(run_id: str) -> TrialRun:
        r = client.get_run(run_id)
        return TrialRun(run_id, r.info.run_name, "FINISHED", 0, dict(r.data.tags), {}, {})

    assert study.history(trial(old), "val/sumr") == study.history(trial(new), "val/sumr") == [(1, 10.0), (2, 20.0)]
