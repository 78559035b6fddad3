"""Nothing between a training run's start and the code that ends it can leave the run RUNNING: a bad
``$PRVRLAB_PROGRESS_S`` is refused (one line naming it) before the run starts, and a console that fails
on the run's first line ends the run FAILED."""

from __future__ import annotations

import mlflow
import pytest

from prvrlab.platform.cli import main
from prvrlab.platform.config import ConfigError, validate
from prvrlab.platform.train.driver import TrainingError, train

from train_helpers import small_raw


def _runs(raw):
    client = mlflow.MlflowClient(tracking_uri=raw["tracking"]["uri"])
    experiment = client.get_experiment_by_name("tests")
    return [] if experiment is None else client.search_runs([experiment.experiment_id])


def test_a_bad_progress_interval_is_refused_before_the_run_starts(tiny_root, tmp_path, monkeypatch):
    raw = small_raw(tiny_root, tmp_path, epochs=1)
    monkeypatch.setenv("PRVRLAB_PROGRESS_S", "often")
    with pytest.raises(ConfigError, match="PRVRLAB_PROGRESS_S='often': expected a number of seconds"):
        train(validate(raw), use_ray=False, echo=print)
    assert [r.info.status for r in _runs(raw)] == []


def test_the_cli_says_so_in_one_line(tiny_root, tmp_path, monkeypatch, capsys):
    import yaml

    raw = small_raw(tiny_root, tmp_path, epochs=1)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(raw))
    monkeypatch.setenv("PRVRLAB_PROGRESS_S", "often")
    assert main(["train", str(path), "--no-ray"]) == 2
    err = capsys.readouterr().err
    assert err == "prvrlab: error: PRVRLAB_PROGRESS_S='often': expected a number of seconds\n"
    assert all(r.info.status != "RUNNING" for r in _runs(raw))


def test_a_console_failing_on_the_first_line_ends_the_run_failed(tiny_root, tmp_path):
    raw = small_raw(tiny_root, tmp_path, epochs=1)

    def console(line):
        if str(line).startswith("run "):
            raise OSError(5, "Input/output error")

    with pytest.raises(TrainingError, match="Input/output error"):
        train(validate(raw), use_ray=False, echo=console)
    (run,) = _runs(raw)
    assert run.info.status == "FAILED"
