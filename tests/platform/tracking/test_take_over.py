"""Taking over a dead driver's run and that driver's closers never interleave (``drivers.driver_lock``).

A ``--resume`` can start while the dead driver's sentinel is still closing its runs; without the lock the
sentinel's check ("RUNNING, driven by my driver") and its close could fall either side of the resume's
reopen, leaving a resumed run KILLED, or RUNNING with a stop reason.  Each interleaving is forced here.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import mlflow
import pytest

from prvrlab.platform.search.ablation import close_orphans
from prvrlab.platform.search.outcome import RunMap
from prvrlab.platform.tracking import closer, drivers
from prvrlab.platform.tracking.drivers import HOST_TAG, driver_alive, driver_lock, driver_tags, lock_path
from prvrlab.platform.tracking.store import Tracker

REASON = {"prvrlab.status": "killed", "prvrlab.stop_reason": "its driver (pid 1) died without closing it"}


@pytest.fixture
def dead():
    """Driver tags of a process of this host that has ended."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    tags = driver_tags(proc.pid)
    proc.communicate(b"")
    assert driver_alive(tags) is False
    yield tags
    path = lock_path(tags)
    path.unlink(missing_ok=True)
    drivers._GAVE_UP.discard(path)


def _tag(tracker: Tracker, run_id: str, tags: dict[str, str]) -> None:
    """Set ``tags`` directly through the client (as another process would)."""
    tracker.client.log_batch(run_id, tags=[mlflow.entities.RunTag(k, v) for k, v in tags.items()])


def _sentinel_close(tracker: Tracker, run_id: str):
    """What close_runs does once it has found the run RUNNING and its driver's."""
    def close() -> None:
        _tag(tracker, run_id, REASON)
        tracker.client.set_terminated(run_id, status="KILLED")

    return close


def _run(tracker: Tracker, driver: dict[str, str], status: str = "RUNNING", **tags: str) -> str:
    run_id = tracker.start_run("run", tags=tags)
    _tag(tracker, run_id, driver)
    if status != "RUNNING":
        tracker.end_run(run_id, status)
    closer.closed(run_id)  # not this process's to close
    return run_id


def _hold(tags: dict[str, str], then=None, hold_s: float = 1.5):
    """A thread that takes the driver's lock (returned, with its release event, once it holds it), waits for
    the event or ``hold_s``, runs ``then`` and lets go."""
    held, release = threading.Event(), threading.Event()

    def body() -> None:
        with driver_lock(tags) as got:
            assert got
            held.set()
            release.wait(hold_s)
            if then is not None:
                then()

    thread = threading.Thread(target=body)
    thread.start()
    assert held.wait(10)
    return thread, release


def test_the_lock_excludes_others_until_released_and_names_only_this_host(tmp_path, dead):
    thread, release = _hold(dead, hold_s=60)
    with driver_lock(dead, wait_s=0.1) as got:
        assert not got  # held elsewhere, given up after the wait
    started = time.monotonic()
    with driver_lock(dead, wait_s=30) as got:
        assert not got and time.monotonic() - started < 10  # given up on once: not waited for again
    release.set()
    thread.join()
    assert not lock_path(dead).exists()  # removed by its holder as it let go
    drivers._GAVE_UP.discard(lock_path(dead))
    with driver_lock(dead, wait_s=0.1) as got:
        assert got and lock_path(dead).exists()
    assert not lock_path(dead).exists()
    other = {**dead, HOST_TAG: socket.gethostname() + "-elsewhere"}
    assert lock_path(other) is None
    with driver_lock(other) as got:
        assert not got


def test_a_reopen_waits_for_the_sentinels_close_and_then_wins(tmp_path, dead):
    """The sentinel checked and holds the lock; the resume's reopen comes after its close, not between."""
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "takeover")
    run_id = _run(tracker, dead)
    thread, _ = _hold(dead, _sentinel_close(tracker, run_id))
    before = tracker.reopen_run(run_id)
    thread.join()
    assert before.info.status == "KILLED"  # what the sentinel left
    run = tracker.client.get_run(run_id)
    assert run.info.status == "RUNNING" and "prvrlab.stop_reason" not in run.data.tags and "prvrlab.status" not in run.data.tags
    assert {k: run.data.tags[k] for k in dead} == driver_tags()
    tracker.end_run(run_id, "FINISHED")


def test_the_sentinel_leaves_a_run_taken_over_while_it_waited(tmp_path, dead):
    """The resume holds the lock first: the sentinel's close_runs waits, then sees another driver."""
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "takeover")
    run_id = _run(tracker, dead)

    def resume_take_over() -> None:  # Tracker.take_over's step under the lock (a second flock here would wait)
        _tag(tracker, run_id, driver_tags())

    thread, _ = _hold(dead, resume_take_over)
    done = closer.close_runs({run_id: tracker.uri}, REASON["prvrlab.stop_reason"], driver=dead)
    thread.join()
    assert done == []
    run = tracker.client.get_run(run_id)
    assert run.info.status == "RUNNING" and "prvrlab.stop_reason" not in run.data.tags


def test_a_closer_writes_the_reason_before_the_status(tmp_path, dead, monkeypatch):
    """Whoever sees the run KILLED (a poll, the UI) also sees why."""
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "takeover")
    run_id = _run(tracker, dead)
    calls = []
    client = mlflow.tracking.MlflowClient
    for name in ("log_batch", "set_terminated"):
        original = getattr(client, name)
        monkeypatch.setattr(client, name, lambda self, *a, _o=original, _n=name, **k: (calls.append(_n), _o(self, *a, **k))[1])
    assert closer.close_runs({run_id: tracker.uri}, "stopped", driver=dead) == [run_id]
    assert calls == ["log_batch", "set_terminated"]


def test_the_next_train_and_an_ablation_leave_runs_their_dead_drivers_sentinel_closed(tmp_path, dead):
    """Found RUNNING, closed by the sentinel while the lock was awaited: not closed again with another reason."""
    from prvrlab.platform.tracking.drivers import close_dead_runs

    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "takeover")
    study = {"prvrlab.study": "abl", "prvrlab.study_kind": "ablation", "prvrlab.kind": "train"}
    run_id = _run(tracker, dead, **study)
    thread, _ = _hold(dead, _sentinel_close(tracker, run_id))
    assert close_dead_runs(tracker) == []
    thread.join()
    assert tracker.client.get_run(run_id).data.tags["prvrlab.stop_reason"] == REASON["prvrlab.stop_reason"]

    other = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        orphans = [_run(tracker, dead, **study), _run(tracker, driver_tags(), **study)]  # a dead driver's, this one's
        live = _run(tracker, driver_tags(other.pid), **study)  # a concurrent driver of the same study, alive
        study_dir = tmp_path / "study"
        study_dir.mkdir()
        assert sorted(close_orphans(tracker, "abl", RunMap(study_dir))) == sorted(orphans)
        for orphan in orphans:
            assert tracker.client.get_run(orphan).data.tags["prvrlab.stop_reason"] == "orphaned: its driver died"
        assert tracker.client.get_run(live).info.status == "RUNNING"
    finally:
        other.communicate(b"")


def test_a_waiter_on_a_lock_file_removed_and_made_again_waits_for_the_new_holder(tmp_path, dead):
    """The holder removes the file as it lets go; a late comer makes a new one: a process that was waiting on
    the old file must not count as holding the lock beside it."""
    import fcntl

    path = lock_path(dead)
    first = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(first, fcntl.LOCK_EX)
    entered = threading.Event()

    def waiter() -> None:
        with driver_lock(dead, wait_s=30) as got:
            assert got
            entered.set()

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.5)  # the waiter is waiting on the first file
    path.unlink()
    late = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(late, fcntl.LOCK_EX)
    os.close(first)  # the first holder lets go: the waiter gets that file's lock, at no path any more
    assert not entered.wait(1.0)  # ... and waits again, on the late comer's
    path.unlink()
    os.close(late)
    assert entered.wait(10)
    thread.join()
    assert not path.exists()


STOPPED = """
import json, sys
from prvrlab.platform.tracking.closer import stop_requested
from prvrlab.platform.tracking.drivers import driver_tags
from prvrlab.platform.tracking.store import Tracker
run_id = Tracker(sys.argv[1], "stopped").start_run("run")
print(json.dumps({"run": run_id, "driver": driver_tags()}), flush=True)
stop_requested("stopped by SIGTERM")
sys.exit(143)  # a driver that winds down in time
"""


def test_a_stopped_driver_leaves_no_lock_file(tmp_path):
    import json

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker(uri, "stopped")
    done = subprocess.run([sys.executable, "-c", STOPPED, uri], capture_output=True, text=True, timeout=120)
    assert done.returncode == 143, done.stderr
    said = json.loads(done.stdout)
    deadline = time.monotonic() + 90
    while (run := tracker.client.get_run(said["run"])).info.status == "RUNNING":  # closed when it exited
        assert time.monotonic() < deadline, "the detached closer did not close the run"
        time.sleep(0.5)
    assert run.info.status == "KILLED" and run.data.tags["prvrlab.stop_reason"] == "stopped by SIGTERM"
    assert not lock_path(said["driver"]).exists()


def test_without_a_writable_lock_folder_the_take_over_goes_on_unlocked(tmp_path, dead, monkeypatch):
    monkeypatch.setattr(drivers, "LOCK_DIR", tmp_path / "missing")
    with driver_lock(dead) as got:
        assert not got
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "takeover")
    run_id = _run(tracker, dead, "KILLED")
    assert tracker.reopen_run(run_id).info.status == "KILLED"
    assert tracker.client.get_run(run_id).info.status == "RUNNING"
    tracker.end_run(run_id, "FINISHED")
