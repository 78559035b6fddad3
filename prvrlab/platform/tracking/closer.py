"""Close this process's open MLflow runs KILLED from a detached process when a stop signal arrives.

``ray job stop`` sends SIGTERM and SIGKILLs the driver ``RAY_JOB_STOP_WAIT_TIME_S``
(3 s) later; schedulers (Slurm, Kubernetes) leave 30 s or so.  On a loaded machine
the driver's own MLflow writes can take longer than that, and a SIGKILLed driver
leaves its runs RUNNING.  So every run this process opens through
:class:`~prvrlab.platform.tracking.store.Tracker` is noted here, and at the first
stop signal :func:`close_in_background` starts a process in its own session that
closes the still-RUNNING ones KILLED with the reason, whatever happens to the
driver.  The driver's own closing (its final word) waits for that process first,
so the two never interleave.  :func:`exit_after` bounds how long a stopped driver
may take to wind down.

A driver killed without a stop signal (SIGKILL, the OOM killer) runs nothing.  A
process that calls :func:`guard_process` (the ``prvrlab`` command does) therefore
starts, with its first run, a *sentinel*: a small process in its own session and
outside the driver's process tree that polls the driver and, once the driver is
gone (or a zombie), closes KILLED the runs the driver's ledger file still lists open.  The driver rewrites the ledger at each
run it opens or closes and removes it at a normal exit, which ends the sentinel.
Only killing the sentinel too (a cgroup kill) leaves runs RUNNING; the next
``prvrlab train`` then closes them (``drivers.close_dead_runs``).
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from prvrlab.platform.tracking.drivers import driver_tags, process_alive, start_time

_OPEN: dict[str, str] = {}  # run id -> tracking URI, the runs this process opened and has not closed
_LOCK = threading.Lock()
_CLOSER: subprocess.Popen | None = None
_STOPPING = threading.Event()
WAIT_S = 30.0  # how long the driver's own closing waits for the detached closer
STOP_GRACE_S = 30.0  # how long a stopped driver may take to wind down before it exits anyway
SENTINEL_ENV = "PRVRLAB_RUN_SENTINEL"  # "0": no sentinel (tests of the next-train fallback)
POLL_S = 1.0  # how often the sentinel looks at its driver
_GUARD = {"on": False, "ledger": None, "sentinel": None}  # this process's sentinel, once started


def guard_process() -> None:
    """Have a sentinel close this process's open runs if it dies without closing them (module docstring)."""
    _GUARD["on"] = os.environ.get(SENTINEL_ENV, "1") != "0"


def opened(uri: str, run_id: str) -> None:
    """Note a run this process opened (or reopened)."""
    with _LOCK:
        _OPEN[run_id] = uri
        if _GUARD["on"]:
            _start_sentinel()
        _write_ledger()


def closed(run_id: str) -> None:
    """Note a run this process closed."""
    with _LOCK:
        _OPEN.pop(run_id, None)
        _write_ledger()


def _write_ledger() -> None:
    """The open runs to the sentinel's ledger (atomically; called holding ``_LOCK``)."""
    ledger = _GUARD["ledger"]
    if ledger is None:
        return
    tmp = ledger.with_name(ledger.name + ".tmp")
    tmp.write_text(json.dumps(_OPEN), encoding="utf-8")
    os.replace(tmp, ledger)


def _start_sentinel() -> None:
    """Start the sentinel unless one is watching (called holding ``_LOCK``).  It forks away from the
    process started here, so it is no descendant of the driver: ``ray job stop`` signals the job's
    whole process tree, which would end it with the driver."""
    sentinel = _GUARD["sentinel"]
    if sentinel is not None and process_alive(sentinel):
        return
    if _GUARD["ledger"] is None:
        fd, name = tempfile.mkstemp(prefix="prvrlab-open-runs-", suffix=".json")
        os.close(fd)
        _GUARD["ledger"] = Path(name)
        atexit.register(_release_ledger)
    starter = subprocess.Popen(
        [sys.executable, "-m", "prvrlab.platform.tracking.closer", "--watch", str(os.getpid()), start_time(os.getpid()),
         str(_GUARD["ledger"])],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        start_new_session=True,  # a group kill of the driver does not reach it
        text=True,
    )
    line = starter.stdout.readline()  # the sentinel's pid, from the process that forked it and exits
    starter.stdout.close()
    starter.wait()
    _GUARD["sentinel"] = int(line) if line.strip().isdigit() else None


def _release_ledger() -> None:
    """At a normal exit with nothing open: remove the ledger, which ends the sentinel."""
    with _LOCK:
        ledger = _GUARD["ledger"]
        if ledger is not None and not _OPEN:
            ledger.unlink(missing_ok=True)


def watch(pid: int, start: str, ledger: Path, *, poll_s: float = POLL_S) -> int:
    """The sentinel: wait until driver ``pid`` is gone, then close the runs its ``ledger`` lists; end
    without closing anything when the ledger disappears (the driver's normal exit)."""
    while process_alive(pid, start):
        if not ledger.exists():
            return 0
        time.sleep(poll_s)
    try:
        runs = json.loads(ledger.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return 0  # removed at the driver's exit, or never written
    finally:
        ledger.unlink(missing_ok=True)
    if not runs:
        return 0
    reason = f"its driver (pid {pid}) died without closing it (SIGKILL or the OOM killer)"
    done = close_runs(dict(runs), reason, driver=driver_tags(pid, start))
    if done:
        print(f"prvrlab: closed {len(done)} run(s) KILLED ({reason})", file=sys.stderr)
    return 0


def open_runs() -> dict[str, str]:
    """This process's open runs (run id -> tracking URI)."""
    with _LOCK:
        return dict(_OPEN)


def close_in_background(reason: str) -> subprocess.Popen | None:
    """Start a detached process that closes this process's open runs KILLED with ``reason``
    (once per process; returns it, or None when nothing is open or it already ran)."""
    global _CLOSER
    runs = open_runs()
    if _CLOSER is not None or not runs:
        return None
    fd, job = tempfile.mkstemp(prefix="prvrlab-close-", suffix=".json")
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json.dump({"reason": reason, "runs": runs, "driver": driver_tags()}, fh)
    _CLOSER = subprocess.Popen(
        [sys.executable, "-m", "prvrlab.platform.tracking.closer", job],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        start_new_session=True,  # outside the driver's process group: a group kill does not reach it
    )
    return _CLOSER


def wait_for_closer(timeout: float = WAIT_S) -> None:
    """Let a running detached closer finish before this process writes to its runs again."""
    proc = _CLOSER
    if proc is None or proc.returncode is not None:
        return
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"prvrlab: the run closer (pid {proc.pid}) is still working after {timeout:.0f} s; going on", file=sys.stderr)


def exit_after(seconds: float, code: int) -> threading.Timer:
    """Exit the process with ``code`` if it is still winding down ``seconds`` from now
    (a stopped driver must end even when Ray's shutdown hangs)."""

    def force() -> None:
        wait_for_closer()
        print(f"prvrlab: still stopping {seconds:.0f} s after the stop signal; exiting now", file=sys.stderr, flush=True)
        os._exit(code)

    timer = threading.Timer(seconds, force)
    timer.daemon = True
    timer.start()
    return timer


def stop_requested(reason: str, *, grace_s: float = STOP_GRACE_S, code: int = 143) -> bool:
    """At the first stop signal: close this process's open runs KILLED from a detached process and
    exit with ``code`` if winding down takes over ``grace_s``; whether this call was the first."""
    if _STOPPING.is_set():
        return False
    _STOPPING.set()
    try:
        close_in_background(reason)
    except Exception as exc:  # noqa: BLE001 - the driver's own closing still runs
        print(f"prvrlab: could not start the run closer: {type(exc).__name__}: {exc}", file=sys.stderr)
    exit_after(grace_s, code)
    return True


def _store_exists(uri: str) -> bool:
    """Whether a local store is still there (a vanished one must not be re-created empty)."""
    if uri.startswith("sqlite:///"):
        return Path(uri[len("sqlite:///") :]).is_file()
    if uri.startswith("file:"):
        return Path(uri[len("file:") :].removeprefix("//")).exists()
    if "://" not in uri:
        return Path(uri).exists()
    return True


def close_runs(runs: dict[str, str], reason: str, *, driver: dict[str, str] | None = None) -> list[str]:
    """Close KILLED with ``reason`` those of ``runs`` (id -> URI) that are still RUNNING; their ids.
    ``driver`` (its ``drivers.driver_tags``): only the runs that process still drives (a run another
    driver reopened since, e.g. ``--resume`` right after a kill, is left alone)."""
    from mlflow.entities import RunTag
    from mlflow.tracking import MlflowClient

    done = []
    by_uri: dict[str, list[str]] = {}
    for run_id, uri in runs.items():
        by_uri.setdefault(uri, []).append(run_id)
    for uri, ids in by_uri.items():
        if not _store_exists(uri):
            continue
        client = MlflowClient(tracking_uri=uri)
        for run_id in ids:
            run = client.get_run(run_id)
            if run.info.status != "RUNNING" or not _driven_by(run.data.tags, driver):
                continue
            client.set_terminated(run_id, status="KILLED")
            client.log_batch(run_id, tags=[RunTag("prvrlab.status", "killed"), RunTag("prvrlab.stop_reason", reason)])
            done.append(run_id)
    return done


def _driven_by(tags: dict[str, str], driver: dict[str, str] | None) -> bool:
    """Whether a run's driver tags name ``driver`` (None, or a run without them: yes)."""
    if driver is None or not all(key in tags for key in driver):
        return True
    return all(tags[key] == value for key, value in driver.items())


def main(argv: list[str] | None = None) -> int:
    """``python -m prvrlab.platform.tracking.closer JOB.json``: close the job's runs, remove the file;
    ``... --watch PID START LEDGER``: the sentinel (:func:`watch`)."""
    args = list(argv if argv is not None else sys.argv[1:])
    if args[:1] == ["--watch"]:
        pid, start, ledger = args[1:]
        child = os.fork()
        if child:  # the starter: say the sentinel's pid and leave it an orphan of no one's tree
            print(child, flush=True)
            os._exit(0)
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        return watch(int(pid), start, Path(ledger))
    (job,) = args
    path = Path(job)
    spec = json.loads(path.read_text(encoding="utf-8"))
    try:
        done = close_runs(dict(spec["runs"]), str(spec["reason"]), driver=spec.get("driver"))
    except Exception as exc:  # noqa: BLE001 - reported, nothing else can be done here
        print(f"prvrlab: could not close the stopped driver's runs: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        path.unlink(missing_ok=True)
    if done:
        print(f"prvrlab: closed {len(done)} run(s) KILLED ({spec['reason']})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
