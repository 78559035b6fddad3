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
from pathlib import Path

HOST_TAG, PID_TAG, START_TAG = "prvrlab.driver_host", "prvrlab.driver_pid", "prvrlab.driver_start"


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
            reason = f"its driver (pid {run.data.tags[PID_TAG]} on {run.data.tags[HOST_TAG]}) died without closing it"
            tracker.set_tags(run.info.run_id, {"prvrlab.status": "killed", "prvrlab.stop_reason": reason})
            tracker.end_run(run.info.run_id, "KILLED")
            closed.append(run.info.run_id)
    return closed
