"""Runs whose driver died without closing them (SIGKILL, OOM killer, power loss).

Every training run records which process drives it (host, pid and the
process's start time, so a reused pid is not mistaken for the driver).  The
next ``prvrlab train`` against the same experiment closes runs left RUNNING
by drivers of this host that no longer exist, as KILLED with the reason.
Drivers on other hosts are left alone (nothing here can tell whether they live).
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

HOST_TAG, PID_TAG, START_TAG = "prvrlab.driver_host", "prvrlab.driver_pid", "prvrlab.driver_start"
LOCK_WAIT_S = 60.0  # how long a process taking over a dead driver's run waits for that driver's closers


def _stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name (stat(5) field 3 onwards), [] where unknown."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot (Linux), '' where unknown."""
    fields = _stat(pid)
    return fields[19] if len(fields) > 19 else ""  # field 22 of stat(5)


def process_state(pid: int) -> str:
    """The process's state letter ("R", "S", "Z" for a zombie, ...), '' where unknown."""
    fields = _stat(pid)
    return fields[0] if fields else ""


def driver_tags(pid: int | None = None, start: str | None = None) -> dict[str, str]:
    """Tags naming this process (or process ``pid`` of this host, started at ``start``) as a run's driver."""
    pid = os.getpid() if pid is None else pid
    return {HOST_TAG: socket.gethostname(), PID_TAG: str(pid), START_TAG: start_time(pid) if start is None else start}


def driver_alive(tags: dict[str, str]) -> bool | None:
    """Whether the driver named by ``tags`` still runs (None: another host, or no driver tags)."""
    if tags.get(HOST_TAG) != socket.gethostname() or not tags.get(PID_TAG, "").isdigit():
        return None
    return process_alive(int(tags[PID_TAG]), tags.get(START_TAG, ""))


def process_alive(pid: int, start: str = "") -> bool:
    """Whether process ``pid`` of this host, started at ``start`` ('' if unknown), still runs: not gone,
    not a zombie, and its pid not reused by another process."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    if process_state(pid) == "Z":
        return False  # dead, not yet reaped by its parent
    return not start or start_time(pid) in ("", start)


def lock_path(tags: dict[str, str]) -> Path | None:
    """The lock file of the driver named by a run's ``tags`` (None: another host, or no driver tags)."""
    if tags.get(HOST_TAG) != socket.gethostname() or not tags.get(PID_TAG, "").isdigit():
        return None
    start = "".join(c for c in tags.get(START_TAG, "") if c.isdigit())
    return Path(tempfile.gettempdir()) / f"prvrlab-driver-{tags[PID_TAG]}-{start}.lock"


@contextmanager
def driver_lock(tags: dict[str, str], *, wait_s: float = LOCK_WAIT_S) -> Iterator[bool]:
    """Hold the lock of the driver that ``tags`` name (this host only) while deciding about its runs.

    The driver's sentinel and its stop-signal closer hold it while they check and close the driver's runs;
    a process taking a dead driver's run over (``Tracker.take_over``: a ``--resume``, a lost-trial or
    orphan closer) holds it while it checks the run and re-tags it with itself, so a closer either
    finishes first or then sees the run driven by another process and leaves it alone.  Yields whether
    the lock was taken (False: another host, no writable temp folder, or still held after ``wait_s``;
    the caller goes on).
    """
    import fcntl

    path = lock_path(tags)
    try:
        fd = None if path is None else os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:  # no temp folder to write in: go on unlocked, as before the lock existed
        fd = None
    if fd is None:
        yield False
        return
    try:
        deadline, held = time.monotonic() + wait_s, False
        while not held:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = True
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.05)
        yield held
    finally:
        os.close(fd)  # releases the lock


def close_dead_runs(tracker, kind: str = "train") -> list[str]:
    """Close this experiment's RUNNING ``kind`` runs whose driver on this host is gone; their ids."""
    runs = tracker.client.search_runs(
        [tracker.experiment_id],
        filter_string=f"attributes.status = 'RUNNING' and tags.`prvrlab.kind` = '{kind}'",
        max_results=1000,
    )
    closed = []
    for run in runs:
        if driver_alive(run.data.tags) is False:
            run = tracker.take_over(run.info.run_id)
            if run.info.status != "RUNNING":  # its sentinel closed it meanwhile
                continue
            reason = f"its driver (pid {run.data.tags[PID_TAG]} on {run.data.tags[HOST_TAG]}) died without closing it"
            tracker.set_tags(run.info.run_id, {"prvrlab.status": "killed", "prvrlab.stop_reason": reason})
            tracker.end_run(run.info.run_id, "KILLED")
            closed.append(run.info.run_id)
    return closed
