"""The driver's run always ends: a step of recording its end that fails (an artifact store that cannot
be written, a console whose reader went away, an interrupt) never leaves it RUNNING."""

from __future__ import annotations

import pytest
import yaml
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from prvrlab.platform import cli
from prvrlab.platform.config import validate
from prvrlab.platform.failures import ERROR_FILE
from prvrlab.platform.train import loop
from prvrlab.platform.train.driver import TrainingError, train
from prvrlab.platform.tracking.store import Tracker

from train_helpers import small_raw

EPOCH = {"kind": "epoch", "epoch": 1, "train/loss": 1.0, "val/sumr": 12.0, "best/sumr": 12.0, "best/epoch": 1, "time/epoch_s": 0.1}
FINAL = {"kind": "final", "best/sumr": 12.0, "best/epoch": 1, "val/sumr": 12.0}


def _runs(raw: dict):
    tracker = Tracker(raw["tracking"]["uri"], raw["tracking"]["experiment"])
    return tracker.client.search_runs([tracker.experiment_id])


def _failing_worker(cfg, run_dir, on_report=None, on_progress=None, sync_to=None):
    raise RuntimeError("boom in the training code")


def _finishing_worker(cfg, run_dir, on_report=None, on_progress=None, sync_to=None):
    on_report(EPOCH)
    on_report(FINAL)


def _raises(error: BaseException):
    def call(*args, **kwargs):
        raise error

    return call


def test_an_artifact_store_that_cannot_be_written_still_ends_the_run_failed(tiny_root, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(loop, "run_local", _failing_worker)
    monkeypatch.setattr(Tracker, "log_artifacts", _raises(NotADirectoryError(20, "Not a directory", str(tmp_path / "mlruns"))))
    raw = small_raw(tiny_root, tmp_path)
    with pytest.raises(TrainingError, match="boom in the training code"):
        train(validate(raw), use_ray=False, echo=None)
    (run,) = _runs(raw)
    assert run.info.status == "FAILED" and "boom in the training code" in run.data.tags["error"]
    assert list(tmp_path.rglob(ERROR_FILE))  # the full text stays in the run's folder
    warning = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("prvrlab: warning:")]
    assert warning == [f"prvrlab: warning: logging {ERROR_FILE} to MLflow failed: NotADirectoryError: "
                       f"[Errno 20] Not a directory: '{tmp_path / 'mlruns'}'"]


def test_an_interrupt_while_the_run_ends_still_ends_it_killed(tiny_root, tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "run_local", _failing_worker)
    monkeypatch.setattr(Tracker, "log_artifacts", _raises(KeyboardInterrupt()))
    raw = small_raw(tiny_root, tmp_path)
    with pytest.raises(KeyboardInterrupt):
        train(validate(raw), use_ray=False, echo=None)
    (run,) = _runs(raw)
    assert run.info.status == "KILLED"


def test_a_console_whose_reader_went_away_neither_fails_nor_strands_the_run(tiny_root, tmp_path, monkeypatch):
    """``prvrlab train ... | head``: every console line raises BrokenPipeError once the reader is gone."""
    monkeypatch.setattr(loop, "run_local", _finishing_worker)
    said: list[str] = []

    def closed_pipe(line: str) -> None:
        said.append(line)
        raise BrokenPipeError(32, "Broken pipe")

    raw = small_raw(tiny_root, tmp_path)
    result = train(validate(raw), use_ray=False, echo=closed_pipe)
    (run,) = _runs(raw)
    assert run.info.status == "FINISHED" and result.best_sumr == FINAL["best/sumr"]
    assert len(said) == 1  # quiet after the first broken write


def test_a_store_error_that_reaches_the_command_line_is_one_line_naming_the_store(tiny_root, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PRVRLAB_RUN_SENTINEL", "0")
    monkeypatch.setattr(loop, "run_local", _finishing_worker)
    set_terminated = MlflowClient.set_terminated

    def end_then_fail(self, run_id, *args, **kwargs):  # the store itself fails, under Tracker.end_run
        set_terminated(self, run_id, *args, **kwargs)
        raise MlflowException("the store went away\nsecond line")

    monkeypatch.setattr(MlflowClient, "set_terminated", end_then_fail)
    raw = small_raw(tiny_root, tmp_path)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert cli.main(["train", str(path), "--no-ray"]) == cli.EXIT_FAILED
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert err == [f"prvrlab: error: MLflow store {raw['tracking']['uri']}: the store went away"]


def test_a_closed_standard_output_is_one_line_and_exit_1(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(cli, "cmd_train", _raises(BrokenPipeError(32, "Broken pipe")))
    assert cli.main(["train", str(tmp_path / "cfg.yaml")]) == cli.EXIT_FAILED
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert err == ["prvrlab: error: [Errno 32] Broken pipe"]
