"""A searched metric the final round lacks gets the best model's value (``best/<name>``, or a validation
metric's value at the best epoch, the one that saved the best model), logged as ``final/<metric>``;
failing both it is filled in for Tune's ranking only (the best of any epoch, not the best model's) and
is not logged as ``final/<metric>``."""

from __future__ import annotations

from types import SimpleNamespace

import mlflow

from prvrlab.platform.search.mlflow_callback import MlflowStudyCallback
from prvrlab.platform.search.outcome import FILLED_KEY, read_outcome, write_outcome
from prvrlab.platform.search.study import MetricFiller

from search_helpers import stand_in_study


def _reports(filler, epochs=True):
    """Two epochs (val/r1 best at epoch 1, best SumR at epoch 2), then a final round on test only
    (``epochs=False``: the epochs' reports went to an earlier process, as before a resume)."""
    if epochs:
        filler({"kind": "epoch", "epoch": 1, "val/r1": 9.0, "best/sumr": 100.0, "best/epoch": 1})
        filler({"kind": "epoch", "epoch": 2, "val/r1": 5.0, "best/sumr": 150.0, "best/epoch": 2})
    return filler({"kind": "final", "best/sumr": 150.0, "best/epoch": 2, "test/r1": 4.0})


def test_the_best_model_s_value_is_taken_where_known():
    final = _reports(MetricFiller("val/r1", "max"))
    assert final["val/r1"] == 5.0 and FILLED_KEY not in final  # epoch 2's: the epoch that saved the best model
    sumr = _reports(MetricFiller("val/sumr", "max"))
    assert sumr["val/sumr"] == 150.0 and FILLED_KEY not in sumr  # best/sumr


def test_the_filler_names_what_it_filled():
    loss = MetricFiller("train/loss", "min")
    loss({"kind": "epoch", "epoch": 1, "train/loss": 0.5})
    loss({"kind": "epoch", "epoch": 2, "train/loss": 0.7})
    final = loss({"kind": "final", "best/sumr": 150.0, "best/epoch": 2})
    assert final["train/loss"] == 0.5 and final[FILLED_KEY] == "train/loss"  # not a validation: the best seen
    own = MetricFiller("test/r1", "max")({"kind": "final", "test/r1": 4.0})
    assert FILLED_KEY not in own  # the round has it: nothing filled
    nothing = _reports(MetricFiller("val/r1", "max"), epochs=False)
    assert "val/r1" not in nothing and FILLED_KEY not in nothing  # nothing seen, nothing filled


def _callback(tmp_path, trial_ids):
    """The study callback with an open child run per trial, as Tune's start left them."""
    study, runs = stand_in_study(tmp_path, "filled", trial_ids)
    callback = MlflowStudyCallback(study)
    callback._open.update(trial_ids)
    return callback, runs, mlflow.MlflowClient(study.tracking_uri)


def test_a_filled_value_is_not_logged_as_a_final_metric(tmp_path):
    callback, runs, client = _callback(tmp_path, ("filled", "evaluated"))
    loss = MetricFiller("train/loss", "min")
    loss({"kind": "epoch", "epoch": 1, "train/loss": 0.5})
    filled = loss({"kind": "final", "best/sumr": 150.0, "best/epoch": 1, "test/r1": 4.0})
    evaluated = _reports(MetricFiller("val/r1", "max"))  # the best epoch's val/r1: the best model's
    for trial_id, final in (("filled", filled), ("evaluated", evaluated)):
        trial = SimpleNamespace(trial_id=trial_id, config={}, last_result={})
        callback.on_trial_result(0, [trial], trial, final)
    logged = {t: client.get_run(run).data.metrics for t, run in runs.items()}
    assert "final/train/loss" not in logged["filled"] and logged["evaluated"]["final/val/r1"] == 5.0
    for metrics in logged.values():
        assert metrics["final/test/r1"] == 4.0 and metrics["best/sumr"] == 150.0
        assert not any(FILLED_KEY in k for k in metrics)


def test_a_recorded_outcome_keeps_what_was_filled(tmp_path):
    loss = MetricFiller("train/loss", "min")
    loss({"kind": "epoch", "epoch": 1, "train/loss": 0.5})
    write_outcome(tmp_path, loss({"kind": "final", "best/sumr": 150.0, "best/epoch": 1}))
    assert read_outcome(tmp_path)[FILLED_KEY] == "train/loss"
