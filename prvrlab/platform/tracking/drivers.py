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
import stat
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

HOST_TAG, PID_TAG, START_TAG = "prvrlab.driver_host", "prvrlab.driver_pid", "prvrlab.driver_start"
LOCK_WAIT_S = 60.0  # how long a process taking over a dead driver's run waits for that driver's closers
LOCK_DIR = Path("/tmp") if Path("/tmp").is_dir() else Path(tempfile.gettempdir())  # one folder, whatever TMPDIR says
_GAVE_UP: set[Path] = set()  # lock files this process waited for in vain (not waited for again)


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


def _of_this_host(tags: dict[str, str]) -> bool:
    """Whether ``tags`` name a driver of this host."""
    return tags.get(HOST_TAG) == socket.gethostname() and tags.get(PID_TAG, "").isdigit()


def driver_alive(tags: dict[str, str]) -> bool | None:
    """Whether the driver named by ``tags`` still runs (None: another host, or no driver tags)."""
    if not _of_this_host(tags):
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
    """The lock file of the driver named by a run's ``tags``, in this user's lock folder under
    :data:`LOCK_DIR` (:func:`private_folder`); None: another host, or no driver tags."""
    if not _of_this_host(tags):
        return None
    start = "".join(c for c in tags.get(START_TAG, "") if c.isdigit())
    return LOCK_DIR / f"prvrlab-locks-{os.getuid()}" / f"prvrlab-driver-{tags[PID_TAG]}-{start}.lock"


def private_folder(folder: Path) -> bool:
    """Make ``folder`` (0700) if it is missing; whether it is a folder of this user's that nobody else can
    write (a link, another user's folder or a loosened one is not used: whoever could write it could hold or
    plant the locks a closer waits for)."""
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(folder)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077


def _locked(path: Path, deadline: float) -> int | None:
    """An open descriptor of ``path`` holding its exclusive lock, the file still at that path (one that was
    removed while this waited is opened again); None when the lock is not had by ``deadline``."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            held = _flock(fd, deadline)
            current = held and _still_at(path, fd)
        except BaseException:
            os.close(fd)
            raise
        if current:
            return fd
        os.close(fd)
        if not held:
            return None


def _flock(fd: int, deadline: float) -> bool:
    """Take the exclusive lock of ``fd``, waiting until ``deadline``; whether it was taken."""
    import fcntl

    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)


def _still_at(path: Path, fd: int) -> bool:
    """Whether the file open as ``fd`` is still the one at ``path`` (the holder removes it as it lets go)."""
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


@contextmanager
def driver_lock(tags: dict[str, str], *, wait_s: float = LOCK_WAIT_S) -> Iterator[bool]:
    """Hold the lock of the driver that ``tags`` name (this host only) while deciding about its runs.

    The driver's sentinel and its stop-signal closer hold it while they check and close the driver's runs;
    a process taking a dead driver's run over (``Tracker.take_over``: a ``--resume``, a lost-trial or
    orphan closer) holds it while it checks the run and re-tags it with itself, so a closer either
    finishes first or then sees the run driven by another process and leaves it alone.  The holder
    removes the file before it lets go (a waiter then opens the path again), so none is left behind.
    Yields whether the lock was taken (False: another host, no usable lock folder, or still held after
    ``wait_s``, once per driver and process: later calls do not wait again); the caller goes on.
    """
    path = lock_path(tags)
    fd = None
    if path is not None and private_folder(path.parent):
        try:
            fd = _locked(path, time.monotonic() + (0.0 if path in _GAVE_UP else wait_s))
        except OSError:  # no folder to write in, or no locks there: go on unlocked, as before the lock existed
            fd = None
        if fd is None:
            _GAVE_UP.add(path)
    if fd is None:
        yield False
        return
    try:
        yield True
    finally:
        try:
            path.unlink(missing_ok=True)  # while still held: nobody holds a lock on a file at no path
        except OSError:
            pass
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
            reason = f"its driver (pid {run.data.tags[PID_TAG]} on {run.data.tags[HOST_TAG]}) died without closing it"
            if tracker.close_abandoned(run.info.run_id, {"prvrlab.status": "killed", "prvrlab.stop_reason": reason}):
                closed.append(run.info.run_id)  # (not closed again when its sentinel did it meanwhile)
    return closed
