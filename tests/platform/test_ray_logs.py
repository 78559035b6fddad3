"""Ray's and Tune's log lines go to the study log; the console keeps errors only."""

from __future__ import annotations

import io
import logging
import warnings

import pytest

from prvrlab.platform.ray_logs import ray_logs_to

pytest.importorskip("ray")  # importing Ray installs the "ray" logger's own stderr handler, as in the CLI

SNAPSHOT = "Experiment state snapshotting has been triggered multiple times in the last 5.0 seconds"


def test_ray_warnings_go_to_the_file_and_errors_still_reach_the_console(tmp_path, capsys):
    ray_logger = logging.getLogger("ray")
    console = logging.StreamHandler(io.StringIO())  # like Ray's own stderr handler (bound to the stream it was made with)
    ray_logger.addHandler(console)
    before = (ray_logger.level, [(h, h.level) for h in ray_logger.handlers])
    tune_logger = logging.getLogger("ray.tune.execution.experiment_state")
    try:
        with ray_logs_to(tmp_path / "study.log") as path:
            tune_logger.warning(SNAPSHOT)
            logging.getLogger("ray.train.v2").info("Attempting to start training worker group of size 2")
            warnings.warn("`use_polars` is deprecated", DeprecationWarning)
            tune_logger.error("Trial t1 errored")
    finally:
        ray_logger.removeHandler(console)
    err = console.stream.getvalue() + capsys.readouterr().err
    assert "snapshotting" not in err and "use_polars" not in err and "worker group" not in err
    assert "Trial t1 errored" in err
    text = path.read_text()
    assert f"WARNING ray.tune.execution.experiment_state: {SNAPSHOT}" in text
    assert "INFO ray.train.v2: Attempting to start" in text and "use_polars" in text and "Trial t1 errored" in text
    assert (ray_logger.level, [(h, h.level) for h in ray_logger.handlers + [console]]) == before  # put back


def test_a_second_study_appends_to_the_same_log(tmp_path):
    for n in range(2):
        with ray_logs_to(tmp_path / "study.log"):
            logging.getLogger("ray.tune").warning(f"submission {n}")
    assert [ln.split(": ")[-1] for ln in (tmp_path / "study.log").read_text().splitlines()] == ["submission 0", "submission 1"]


def test_a_failed_trials_traceback_goes_to_the_file_only(tmp_path):
    """Tune logs every failed attempt with its traceback at ERROR; the console gets the progress line instead."""
    ray_logger = logging.getLogger("ray")
    console = logging.StreamHandler(io.StringIO())
    ray_logger.addHandler(console)
    controller = logging.getLogger("ray.tune.execution.tune_controller")
    try:
        with ray_logs_to(tmp_path / "study.log") as path:
            try:
                raise RuntimeError("rank 1 died")
            except RuntimeError as exc:
                controller.error("Trial task failed for trial %s", "run_trial_7f82d043", exc_info=exc)
            controller.error("Trials did not complete: [run_trial_7f82d043]")
        controller.error("Trial task failed for trial %s", "run_trial_after")  # the filter leaves with the block
    finally:
        ray_logger.removeHandler(console)
    err = console.stream.getvalue()
    assert "run_trial_7f82d043" in err and "Trials did not complete" in err
    assert "Trial task failed for trial run_trial_7f82d043" not in err and "rank 1 died" not in err
    assert "Trial task failed for trial run_trial_after" in err
    assert console.filters == []
    text = path.read_text()
    assert "ERROR ray.tune.execution.tune_controller: Trial task failed for trial run_trial_7f82d043" in text
    assert "RuntimeError: rank 1 died" in text
