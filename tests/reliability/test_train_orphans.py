"""A ``prvrlab train`` killed hard (SIGKILL) leaves its run RUNNING; the next train closes it as KILLED."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from prvrlab.platform.cli import main
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


@pytest.mark.slow
def test_a_sigkilled_train_is_closed_by_the_next_one(tiny_root, tmp_path):
    raw = small_raw(tiny_root, tmp_path, epochs=500, early_stop_patience=500)
    Tracker(raw["tracking"]["uri"], raw["tracking"]["experiment"])  # create the store before two processes race
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(raw))
    proc = subprocess.Popen(
        [sys.executable, "-m", "prvrlab.platform.cli", "train", str(config), "--no-ray"],
        start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 90
    while not any(r.info.status == "RUNNING" for r in runs(raw)):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    (orphan,) = runs(raw)
    assert orphan.info.status == "RUNNING"  # nothing could close it

    assert main(["train", str(config), "--no-ray", "--set", "train.epochs=1"]) == 0
    by_id = {r.info.run_id: r for r in runs(raw)}
    assert by_id[orphan.info.run_id].info.status == "KILLED"
    assert "died" in by_id[orphan.info.run_id].data.tags["prvrlab.stop_reason"]
    assert sorted(r.info.status for r in by_id.values()) == ["FINISHED", "KILLED"]  # none left RUNNING
