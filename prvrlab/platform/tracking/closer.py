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
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

_OPEN: dict[str, str] = {}  # run id -> tracking URI, the runs this process opened and has not closed
_LOCK = threading.Lock()
_CLOSER: subprocess.Popen | None = None
_STOPPING = threading.Event()
WAIT_S = 30.0  # how long the driver's own closing waits for the detached closer
STOP_GRACE_S = 30.0  # how long a stopped driver may take to wind down before it exits anyway


def opened(uri: str, run_id: str) -> None:
    """Note a run this process opened (or reopened)."""
    with _LOCK:
        _OPEN[run_id] = uri


def closed(run_id: str) -> None:
    """Note a run this process closed."""
    with _LOCK:
        _OPEN.pop(run_id, None)


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
        json.dump({"reason": reason, "runs": runs}, fh)
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


def close_runs(runs: dict[str, str], reason: str) -> list[str]:
    """Close KILLED with ``reason`` those of ``runs`` (id -> URI) that are still RUNNING; their ids."""
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
            if client.get_run(run_id).info.status != "RUNNING":
                continue
            client.set_terminated(run_id, status="KILLED")
            client.log_batch(run_id, tags=[RunTag("prvrlab.status", "killed"), RunTag("prvrlab.stop_reason", reason)])
            done.append(run_id)
    return done


def main(argv: list[str] | None = None) -> int:
    """``python -m prvrlab.platform.tracking.closer JOB.json``: close the job's runs, remove the file."""
    (job,) = argv if argv is not None else sys.argv[1:]
    path = Path(job)
    spec = json.loads(path.read_text(encoding="utf-8"))
    try:
        done = close_runs(dict(spec["runs"]), str(spec["reason"]))
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
