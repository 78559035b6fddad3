"""On a full disk the error text cannot be written: the run then neither logs an empty error.txt artifact nor
points the user at it; it still ends FAILED with the failure's summary."""

from __future__ import annotations

import errno

import mlflow
import pytest

from prvrlab.platform.config import validate
from prvrlab.platform.failures import ERROR_FILE
from prvrlab.platform.train import driver, loop
from prvrlab.platform.train.driver import TrainingError, train

from train_helpers import small_raw


@pytest.mark.parametrize("disk_full", [True, False])
def test_an_error_text_that_could_not_be_written_is_neither_logged_nor_pointed_at(tiny_root, tmp_path, monkeypatch, disk_full):
    raw = small_raw(tiny_root, tmp_path, epochs=1)

    def broken(*args, **kwargs):
        raise RuntimeError("boom in the loop")

    def no_space(path, *args, **kwargs):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")  # opened, then the first write failed
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(loop, "run_local", broken)
    if disk_full:
        monkeypatch.setattr(driver, "record_failure", no_space)
    said = []
    with pytest.raises(TrainingError, match="boom in the loop"):
        train(validate(raw), use_ray=False, echo=said.append)
    client = mlflow.MlflowClient(tracking_uri=raw["tracking"]["uri"])
    (run,) = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    assert run.info.status == "FAILED"
    logged = {a.path for a in client.list_artifacts(run.info.run_id)}
    pointed = any(line.startswith("full error text: ") for line in said)
    assert (ERROR_FILE in logged) == pointed == (not disk_full), (logged, said)
