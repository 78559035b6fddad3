"""One epoch convention everywhere: counted from 1 (console, MLflow steps and best/epoch, model files, reports)."""

from __future__ import annotations

import re

import mlflow
import torch

from prvrlab.platform.config import validate
from prvrlab.platform.tracking.store import Tracker
from prvrlab.platform.train.checkpoint_eval import checkpoint_epoch
from prvrlab.platform.train.driver import train
from prvrlab.reports.source import Study, TrialRun

from train_helpers import small_raw


def test_console_mlflow_and_model_file_count_epochs_from_one(tiny_root, tmp_path):
    raw = small_raw(tiny_root, tmp_path, epochs=3)
    lines: list[str] = []
    result = train(validate(raw), use_ray=False, echo=lines.append)
    assert [h["epoch"] for h in result.history] == [1, 2, 3]
    sumrs = [h["val/sumr"] for h in result.history]
    best = 1 + max(range(3), key=lambda i: (sumrs[i], -i))  # the first epoch reaching the best value
    assert result.best_epoch == best

    epoch_lines = [ln for ln in lines if ln.startswith("epoch ")]
    assert [re.match(r"epoch +(\d+)/3", ln).group(1) for ln in epoch_lines] == ["1", "2", "3"]
    assert re.search(r"best [\d.]+@(\d+)", epoch_lines[-1]).group(1) == str(best)

    tracker = Tracker(raw["tracking"]["uri"], "tests")
    (run,) = tracker.client.search_runs([tracker.experiment_id])
    assert [m.step for m in tracker.client.get_metric_history(run.info.run_id, "val/sumr")] == [1, 2, 3]
    assert run.data.metrics["best/epoch"] == best
    assert run.data.tags["prvrlab.epoch_base"] == "1"

    blob = torch.load(result.run_dir / "best_model.pt", map_location="cpu", weights_only=True)
    assert blob["format"] == 3 and blob["epoch"] == best == checkpoint_epoch(blob)


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
