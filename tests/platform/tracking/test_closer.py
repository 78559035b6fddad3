"""The detached run closer: a stopped driver's runs end KILLED even when the driver is SIGKILLed at once."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from prvrlab.platform.tracking import closer
from prvrlab.platform.tracking.drivers import driver_tags, process_state
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


GUARDED = """
import json, os, signal, sys, time
from prvrlab.platform.tracking import closer
from prvrlab.platform.tracking.store import Tracker
closer.guard_process()
tracker = Tracker(sys.argv[1], "guarded")
ids = [tracker.start_run("parent"), tracker.start_run("child")]
tracker.end_run(ids[1], "FINISHED")
sentinel, ledger = closer._GUARD["sentinel"][0], closer._GUARD["ledger"]
ppid = open(f"/proc/{sentinel}/stat").read().rsplit(")", 1)[1].split()[1]
assert int(ppid) != os.getpid(), "the sentinel must not be the driver's descendant"
assert [os.readlink(f"/proc/{sentinel}/fd/{fd}") for fd in (1, 2)] == [os.devnull] * 2, "holds the driver's streams"
assert os.readlink(f"/proc/{sentinel}/cwd") == "/", "pins the driver's working directory"
assert ledger.stat().st_mode & 0o777 == 0o600, "the ledger (tracking URIs) must be private"
print(" ".join(ids), sentinel, ledger, json.dumps(json.loads(ledger.read_text())), flush=True)
if sys.argv[2] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)  # no stop signal first: nothing of this process runs
tracker.end_run(ids[0], "FINISHED")
"""


def _gone(pid: int) -> bool:
    return process_state(pid) in ("", "Z")


def test_a_guarded_driver_killed_outright_has_its_open_runs_closed_by_its_sentinel(tmp_path):
    """SIGKILL with no stop signal (as the OOM killer): the sentinel sees its driver gone, a zombie here
    (nothing reaps it), and closes the run the ledger still lists; the run the driver closed stays."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker(uri, "guarded")
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(GUARDED), uri, "kill"], stdout=subprocess.PIPE, text=True)
    parent, child, sentinel, ledger, listed = proc.stdout.readline().split(maxsplit=4)
    assert json.loads(listed)["runs"] == {parent: uri}  # the child was closed before the ledger was read
    deadline = time.monotonic() + 90  # the sentinel imports MLflow once its driver is gone, closes, ends
    while not _gone(int(sentinel)):  # read the store once its writer is done (SQLite locks)
        assert time.monotonic() < deadline, "the sentinel did not end"
        time.sleep(0.2)
    assert process_state(proc.pid) == "Z"  # not reaped: the sentinel took the zombie for dead
    assert proc.wait(timeout=10) == -9
    status, tags = _status(tracker, parent)
    assert status == "KILLED" and "died without closing it" in tags["prvrlab.stop_reason"], tags
    assert str(proc.pid) in tags["prvrlab.stop_reason"]
    assert _status(tracker, child)[0] == "FINISHED"
    assert not Path(ledger).exists()


KILLED_BEFORE_LISTING = """
import os, signal, sys
from prvrlab.platform.tracking import closer
from prvrlab.platform.tracking.store import Tracker
closer.guard_process()
tracker = Tracker(sys.argv[1], "window")

def killed_before_listing(uri, run_id):  # the instant after create_run, before the ledger lists the run
    print(run_id, closer._GUARD["sentinel"][0], flush=True)
    os.kill(os.getpid(), signal.SIGKILL)

closer.opened = killed_before_listing
tracker.start_run("parent")
"""


def test_a_driver_killed_before_its_new_run_is_listed_still_has_it_closed(tmp_path):
    """The sentinel is started and the store noted before the run is created; a kill between the run turning
    RUNNING and the ledger listing it is caught by the sentinel's search for its driver's RUNNING runs."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker(uri, "window")
    other = tracker.start_run("another driver's")  # this test process's: left alone
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(KILLED_BEFORE_LISTING), uri], stdout=subprocess.PIPE, text=True)
    run_id, sentinel = proc.stdout.readline().split()
    assert proc.wait(timeout=30) == -9
    deadline = time.monotonic() + 90
    while not _gone(int(sentinel)):
        assert time.monotonic() < deadline, "the sentinel did not end"
        time.sleep(0.2)
    status, tags = _status(tracker, run_id)
    assert status == "KILLED" and f"driver (pid {proc.pid}) died" in tags["prvrlab.stop_reason"], tags
    assert _status(tracker, other)[0] == "RUNNING"
    tracker.end_run(other, "FINISHED")


def test_a_guarded_driver_that_ends_normally_ends_its_sentinel_and_closes_nothing(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker(uri, "guarded")
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(GUARDED), uri, "end"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    parent, child, sentinel, ledger, _ = done.stdout.split(maxsplit=4)
    assert not Path(ledger).exists()  # removed at exit
    deadline = time.monotonic() + 30
    while not _gone(int(sentinel)):  # it polls once a second
        assert time.monotonic() < deadline, "the sentinel outlived its driver's normal exit"
        time.sleep(0.2)
    for run_id in (parent, child):
        status, tags = _status(tracker, run_id)
        assert status == "FINISHED" and "prvrlab.stop_reason" not in tags


def test_the_sentinel_is_off_without_guard_or_with_the_env_switch(monkeypatch):
    monkeypatch.setitem(closer._GUARD, "on", False)
    monkeypatch.setenv(closer.SENTINEL_ENV, "0")
    closer.guard_process()
    assert closer._GUARD["on"] is False
    monkeypatch.delenv(closer.SENTINEL_ENV)
    closer.guard_process()
    assert closer._GUARD["on"] is True


def test_the_closers_close_only_the_runs_their_driver_still_drives(tmp_path):
    """Every run records its driver (host, pid, start time), re-recorded when a run is reopened: a dead
    driver's closer or sentinel leaves alone a run that ``--resume`` has reopened in the meantime."""
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "owners")
    mine, theirs, untagged = tracker.start_run("mine"), tracker.start_run("theirs"), tracker.start_run("untagged")
    me = driver_tags()
    assert {k: _status(tracker, mine)[1][k] for k in me} == me
    dead = driver_tags(pid=1, start="0")
    tracker.set_tags(theirs, dead)  # as if a driver now dead had opened it
    for key in me:
        tracker.client.delete_tag(untagged, key)  # a run from before the driver tags
    assert closer.close_runs({theirs: tracker.uri}, "by the new driver", driver=me) == []  # not its run
    tracker.reopen_run(theirs)
    assert {k: _status(tracker, theirs)[1][k] for k in me} == me  # reopened: this process drives it now
    runs = {mine: tracker.uri, theirs: tracker.uri, untagged: tracker.uri}
    assert closer.close_runs(runs, "by the dead driver", driver=dead) == [untagged]
    assert _status(tracker, mine)[0] == _status(tracker, theirs)[0] == "RUNNING"
    assert sorted(closer.close_runs(runs, "by this driver", driver=me)) == sorted([mine, theirs])


def test_the_helpers_import_nothing_from_the_working_directory(tmp_path):
    """A dataset or config folder's ``json.py`` must not run in the sentinel or closer: they start from /
    and, where the working directory would be first on sys.path (``python -m``), leave it off (-P)."""
    (tmp_path / "json.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    job = tmp_path / "job.json"
    job.write_text('{"reason": "test", "runs": {}}')
    kwargs = closer.helper_command(str(job))
    assert kwargs["cwd"] == "/"
    assert subprocess.run(**{**kwargs, "cwd": str(tmp_path)}, capture_output=True, timeout=120).returncode == 0
    assert not (tmp_path / "ran").exists() and not job.exists()


SIGTERM_IN_BOOKKEEPING = """
import signal, sys, time
from prvrlab.platform.tracking import closer
from prvrlab.platform.tracking.store import Tracker

def terminate(signum, frame):
    closer.stop_requested("stopped by SIGTERM", grace_s=60)
    raise KeyboardInterrupt

signal.signal(signal.SIGTERM, terminate)
write = closer._write_ledger
def write_then_stop():  # the stop signal arrives while the bookkeeping holds its lock, a run listed
    write()
    if closer._OPEN:
        signal.raise_signal(signal.SIGTERM)
closer._write_ledger = write_then_stop
closer.guard_process()
tracker = Tracker(sys.argv[1], "stop")
try:
    tracker.start_run("parent")
except KeyboardInterrupt:
    closer.wait_for_closer()
    print("stopped", list(closer.open_runs()), flush=True)
"""


def test_a_stop_signal_during_the_bookkeeping_does_not_deadlock(tmp_path):
    """The handler runs in the main thread, which may hold the bookkeeping's lock (it was a plain lock:
    the driver hung); the stop still closes the run KILLED from the detached closer."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker(uri, "stop")
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(SIGTERM_IN_BOOKKEEPING), uri],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    word, listed = done.stdout.split(maxsplit=1)
    (run_id,) = eval(listed)  # noqa: S307 - the script's own printout of a list of ids
    assert word == "stopped"
    status, tags = _status(tracker, run_id)
    assert status == "KILLED" and tags["prvrlab.stop_reason"] == "stopped by SIGTERM"


def test_close_runs_goes_on_past_a_run_it_cannot_close(tmp_path, capsys):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker(uri, "bad")
    good = tracker.start_run("good")
    assert closer.close_runs({"0" * 32: uri, good: uri}, "test") == [good]
    assert "could not close run 0000" in capsys.readouterr().err
    assert _status(tracker, good)[0] == "KILLED"
    closer.closed(good)


def test_the_ledger_is_private_and_unguarding_ends_the_sentinel_when_nothing_is_open(tmp_path, monkeypatch):
    ledger = tmp_path / "ledger.json"
    monkeypatch.setitem(closer._GUARD, "on", False)
    monkeypatch.setitem(closer._GUARD, "ledger", ledger)
    monkeypatch.setitem(closer._GUARD, "sentinel", None)
    monkeypatch.setattr(closer, "_OPEN", {})
    closer.opened("sqlite:///relative.db", "r1")
    assert ledger.stat().st_mode & 0o777 == 0o600
    assert json.loads(ledger.read_text())["runs"] == {"r1": f"sqlite:///{Path.cwd().resolve() / 'relative.db'}"}
    closer.unguard_process()
    assert ledger.exists()  # a run is still open: still watched
    closer.closed("r1")
    assert json.loads(ledger.read_text())["runs"] == {} and sorted(p.name for p in tmp_path.iterdir()) == ["ledger.json"]
    closer.unguard_process()
    assert not ledger.exists() and closer._GUARD["ledger"] is None
