"""A training run carries ``prvrlab.status`` as it ends (finished | error | killed), as trials do, so
one tag filters every run of an experiment in the MLflow UI."""

from __future__ import annotations

import mlflow
import pytest

from prvrlab.platform.config import validate
from prvrlab.platform.train import loop
from prvrlab.platform.train.driver import TrainingError, train

from train_helpers import small_raw


def _run(raw):
    client = mlflow.MlflowClient(tracking_uri=raw["tracking"]["uri"])
    (run,) = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    return run


@pytest.mark.parametrize("raised, expected", [(RuntimeError("boom"), TrainingError), (KeyboardInterrupt(), KeyboardInterrupt)])
def test_a_stopped_run_says_how(tiny_root, tmp_path, monkeypatch, raised, expected):
    raw = small_raw(tiny_root, tmp_path, epochs=1)

    def stops(*args, **kwargs):
        raise raised

    monkeypatch.setattr(loop, "run_local", stops)
    with pytest.raises(expected):
        train(validate(raw), use_ray=False, echo=None)
    run = _run(raw)
    if expected is KeyboardInterrupt:
        assert run.info.status == "KILLED" and run.data.tags["prvrlab.status"] == "killed"
        assert run.data.tags["prvrlab.stop_reason"] == "interrupted"
    else:
        assert run.info.status == "FAILED" and run.data.tags["prvrlab.status"] == "error"


@pytest.mark.slow
def test_a_finished_run_says_so(tiny_root, tmp_path):
    raw = small_raw(tiny_root, tmp_path, epochs=1)
    train(validate(raw), use_ray=False, echo=None)
    run = _run(raw)
    assert run.info.status == "FINISHED" and run.data.tags["prvrlab.status"] == "finished"
