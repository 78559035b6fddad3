"""The detached run closer: a stopped driver's runs end KILLED even when the driver is SIGKILLed at once."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

from prvrlab.platform.tracking import closer
from prvrlab.platform.tracking.store import Tracker


def _status(tracker: Tracker, run_id: str) -> tuple[str, dict]:
    run = tracker.client.get_run(run_id)
    return run.info.status, run.data.tags


def test_the_tracker_notes_what_this_process_has_open(tmp_path):
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "notes")
    run_id = tracker.start_run("a")
    assert closer.open_runs()[run_id] == tracker.uri
    tracker.set_tags(run_id, {"prvrlab.status": "killed", "prvrlab.stop_reason": "stopped by SIGTERM", "kept": "1"})
    tracker.end_run(run_id, "KILLED")
    assert run_id not in closer.open_runs()
    before = tracker.reopen_run(run_id)
    assert before.info.status == "KILLED" and before.data.tags["prvrlab.stop_reason"] == "stopped by SIGTERM"
    status, tags = _status(tracker, run_id)
    assert status == "RUNNING" and "prvrlab.status" not in tags and "prvrlab.stop_reason" not in tags and tags["kept"] == "1"
    assert closer.open_runs()[run_id] == tracker.uri
    tracker.end_run(run_id, "FINISHED")
    assert run_id not in closer.open_runs()


def test_close_runs_closes_only_the_running_ones_and_never_creates_a_store(tmp_path):
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "close")
    running, finished = tracker.start_run("running"), tracker.start_run("finished")
    tracker.end_run(finished, "FINISHED")
    gone = f"sqlite:///{tmp_path / 'gone' / 'mlflow.db'}"

    done = closer.close_runs({running: tracker.uri, finished: tracker.uri, "x" * 32: gone}, "stopped by a test")

    assert done == [running]
    status, tags = _status(tracker, running)
    assert status == "KILLED" and tags["prvrlab.stop_reason"] == "stopped by a test" and tags["prvrlab.status"] == "killed"
    assert _status(tracker, finished)[0] == "FINISHED" and "prvrlab.stop_reason" not in _status(tracker, finished)[1]
    assert not (tmp_path / "gone").exists()


DRIVER = """
import os, signal, sys
from prvrlab.platform.tracking.closer import stop_requested
from prvrlab.platform.tracking.store import Tracker
tracker = Tracker(sys.argv[1], "stopped")
ids = [tracker.start_run("parent"), tracker.start_run("child")]
tracker.end_run(ids[1], "FINISHED")
print(" ".join(ids), flush=True)
stop_requested("stopped by SIGTERM")
os.kill(os.getpid(), signal.SIGKILL)  # as ray job stop does 3 s after its SIGTERM, here at once
"""


def test_a_driver_killed_right_after_the_stop_signal_still_has_its_runs_closed(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker(uri, "stopped")  # the store exists before the driver writes to it
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(DRIVER), uri], capture_output=True, text=True, timeout=120)
    assert done.returncode == -9, done.stderr
    parent, child = done.stdout.split()
    deadline = time.monotonic() + 90  # the closer imports MLflow first
    while _status(tracker, parent)[0] == "RUNNING":
        assert time.monotonic() < deadline, "the detached closer did not close the run"
        time.sleep(0.5)
    status, tags = _status(tracker, parent)
    assert status == "KILLED" and tags["prvrlab.stop_reason"] == "stopped by SIGTERM"
    assert _status(tracker, child)[0] == "FINISHED"  # closed by the driver itself: left alone


def test_a_stopped_driver_that_hangs_exits_after_the_grace_period():
    code = "from prvrlab.platform.tracking.closer import exit_after; import time; exit_after(1, 143); time.sleep(60)"
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert done.returncode == 143 and time.monotonic() - started < 45
    assert "exiting now" in done.stderr
