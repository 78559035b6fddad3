"""A searched metric the final round lacks is filled in for Tune's ranking only: the trial's MLflow run
keeps ``final/*`` for evaluations of the best model, so a filled value (the best of any epoch, not the
best model's) is not logged as ``final/<metric>``."""

from __future__ import annotations

from types import SimpleNamespace

import mlflow

from prvrlab.platform.search.mlflow_callback import MlflowStudyCallback
from prvrlab.platform.search.outcome import FILLED_KEY, read_outcome, write_outcome
from prvrlab.platform.search.study import MetricFiller

from search_helpers import stand_in_study


def _reports(filler):
    """Two epochs (val/r1 best at epoch 1, best SumR at epoch 2), then a final round on test only."""
    filler({"kind": "epoch", "epoch": 1, "val/r1": 9.0, "best/sumr": 100.0, "best/epoch": 1})
    filler({"kind": "epoch", "epoch": 2, "val/r1": 5.0, "best/sumr": 150.0, "best/epoch": 2})
    return filler({"kind": "final", "best/sumr": 150.0, "best/epoch": 2, "test/r1": 4.0})


def test_the_filler_names_what_it_filled():
    final = _reports(MetricFiller("val/r1", "max"))
    assert final["val/r1"] == 9.0 and final[FILLED_KEY] == "val/r1"  # Tune ranks by the best seen
    own = MetricFiller("test/r1", "max")({"kind": "final", "test/r1": 4.0})
    assert FILLED_KEY not in own  # the round has it: nothing filled


def _callback(tmp_path, trial_ids):
    """The study callback with an open child run per trial, as Tune's start left them."""
    study, runs = stand_in_study(tmp_path, "filled", trial_ids)
    callback = MlflowStudyCallback(study)
    callback._open.update(trial_ids)
    return callback, runs, mlflow.MlflowClient(study.tracking_uri)


def test_a_filled_value_is_not_logged_as_a_final_metric(tmp_path):
    callback, runs, client = _callback(tmp_path, ("filled", "evaluated"))
    filled = _reports(MetricFiller("val/r1", "max"))  # no val split in the final round: filled from epoch 1
    evaluated = MetricFiller("val/r1", "max")(  # the best model's own val/r1
        {"kind": "final", "best/sumr": 150.0, "best/epoch": 2, "test/r1": 4.0, "val/r1": 5.0}
    )
    for trial_id, final in (("filled", filled), ("evaluated", evaluated)):
        trial = SimpleNamespace(trial_id=trial_id, config={}, last_result={})
        callback.on_trial_result(0, [trial], trial, final)
    logged = {t: client.get_run(run).data.metrics for t, run in runs.items()}
    assert "final/val/r1" not in logged["filled"] and logged["evaluated"]["final/val/r1"] == 5.0
    for metrics in logged.values():
        assert metrics["final/test/r1"] == 4.0 and metrics["best/sumr"] == 150.0
        assert not any(FILLED_KEY in k for k in metrics)


def test_a_recorded_outcome_keeps_what_was_filled(tmp_path):
    final = _reports(MetricFiller("val/r1", "max"))
    write_outcome(tmp_path, final)
    assert read_outcome(tmp_path)[FILLED_KEY] == "val/r1"
