"""A ``prvrlab train`` killed hard (SIGKILL, no stop signal first): its sentinel closes the run KILLED; with
the sentinel gone too, the run stays RUNNING until the next train closes it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from prvrlab.platform.cli import main
from prvrlab.platform.tracking import closer
from prvrlab.platform.tracking.drivers import driver_alive, driver_tags
from prvrlab.platform.tracking.store import Tracker

from train_helpers import small_raw


def runs(raw: dict):
    tracker = Tracker(raw["tracking"]["uri"], raw["tracking"]["experiment"])
    return tracker.client.search_runs([tracker.experiment_id])


def test_driver_liveness_from_tags():
    assert driver_alive(driver_tags()) is True
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = dict(driver_tags(), **{"prvrlab.driver_pid": done.stdout.strip()})
    assert driver_alive(dead) is False
    assert driver_alive(dict(driver_tags(), **{"prvrlab.driver_host": "elsewhere"})) is None  # cannot tell
    assert driver_alive(dict(driver_tags(), **{"prvrlab.driver_start": "1"})) is False  # a reused pid


def killed_train(raw: dict, tmp_path, *, sentinel: bool) -> subprocess.Popen:
    """A ``prvrlab train`` (500 epochs) SIGKILLed with its process group once its run is RUNNING."""
    Tracker(raw["tracking"]["uri"], raw["tracking"]["experiment"])  # create the store before two processes race
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(raw))
    env = {**os.environ, closer.SENTINEL_ENV: "1" if sentinel else "0"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "prvrlab.platform.cli", "train", str(config), "--no-ray"],
        start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
    )
    deadline = time.monotonic() + 90
    while not any(r.info.status == "RUNNING" for r in runs(raw)):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    return proc


@pytest.mark.slow
def test_a_sigkilled_train_has_its_run_closed_by_its_sentinel(tiny_root, tmp_path):
    """The OOM killer's way: no stop signal, the whole process group at once; the sentinel (its own
    session) closes the run without any later command."""
    raw = small_raw(tiny_root, tmp_path, epochs=500, early_stop_patience=500)
    proc = killed_train(raw, tmp_path, sentinel=True)
    deadline = time.monotonic() + 90
    while (run := runs(raw)[0]).info.status == "RUNNING":
        assert time.monotonic() < deadline, "the sentinel did not close the run"
        time.sleep(1.0)
    assert run.info.status == "KILLED" and f"driver (pid {proc.pid}) died" in run.data.tags["prvrlab.stop_reason"]


@pytest.mark.slow
def test_a_sigkilled_train_is_closed_by_the_next_one(tiny_root, tmp_path):
    """Without the sentinel (killed as well, e.g. a cgroup kill) the next train closes the run."""
    raw = small_raw(tiny_root, tmp_path, epochs=500, early_stop_patience=500)
    killed_train(raw, tmp_path, sentinel=False)
    config = tmp_path / "c.yaml"
    (orphan,) = runs(raw)
    assert orphan.info.status == "RUNNING"  # nothing could close it

    assert main(["train", str(config), "--no-ray", "--set", "train.epochs=1"]) == 0
    by_id = {r.info.run_id: r for r in runs(raw)}
    assert by_id[orphan.info.run_id].info.status == "KILLED"
    assert "died" in by_id[orphan.info.run_id].data.tags["prvrlab.stop_reason"]
    assert sorted(r.info.status for r in by_id.values()) == ["FINISHED", "KILLED"]  # none left RUNNING
