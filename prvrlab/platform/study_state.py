"""Checksums of a study's Ray Tune state, the only record ``--resume`` trusts before Tune unpickles it.

The driver records the state when its run ends (:func:`record_state`); a driver killed outright records
nothing, so its run sentinel (:mod:`prvrlab.platform.tracking.closer`) records it once the driver is gone, so
are the trial processes of this host that wrote for it (:func:`register_writer`), and the folder has stopped
changing (:func:`record_settled`).  The record is this user's, outside the study
folder (:func:`state_record`): whoever can write the folder or its bucket cannot vouch for what they wrote.
Light on imports: the sentinel loads this module.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Callable

from prvrlab.cache import cache_root
from prvrlab.files import write_text_atomically
from prvrlab.platform import storage
from prvrlab.platform.tracking.drivers import HOST_TAG, PID_TAG, START_TAG, driver_alive, driver_tags, private_folder

STATE_SUMS = "state.sha256"  # sha256 of every file under tune/, written by the driver after each run
TRUST_STATE_ENV = "PRVRLAB_TRUST_STUDY_STATE"  # 1: resume a study this user has no record of
WRITERS = "writers"  # <study>/writers/<host>.<pid>.<start>.json: a trial process that writes under tune/


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def state_sums(study_dir: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under ``<study>/tune`` (what a restore may unpickle)."""
    tune_dir = study_dir / "tune"
    files = sorted(p for p in tune_dir.rglob("*") if p.is_file() and not p.is_symlink()) if tune_dir.is_dir() else []
    return {str(p.relative_to(study_dir)): _sha256(p) for p in files}


def state_record(study_dir: Path, uri: str | None = None) -> Path:
    """This user's record of the checksums of a study's Tune state, outside the study folder (nobody who can
    write the folder or its bucket can vouch for what they wrote): ``<cache>/study-state/<key>.sha256``, keyed
    by the study's object-store URI, else by its resolved folder."""
    key = uri if uri and storage.is_remote(uri) else str(Path(study_dir).resolve())
    return cache_root() / "study-state" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.sha256"


_CLAIMS: dict[Path, int] = {}  # lock file -> the descriptor holding it while this process runs that study


def study_lock(study_dir: Path, uri: str | None = None) -> Path:
    """This user's lock file of a study on this machine, keyed as its :func:`state_record`."""
    record = state_record(study_dir, uri)
    return record.parent.parent / "study-locks" / record.with_suffix(".lock").name


def claim_study(study_dir: Path, uri: str | None = None, *, hold: bool = True) -> int | None:
    """Take this user's lock of the study on this machine (held until :func:`release_studies` or the process
    ends, a kill included: the kernel drops it), so that two drivers cannot run, resume or pull one study at
    once; None when taken (or already held by this process; or no private lock folder: then unlocked), else
    the pid of the process holding it (0 when unknown).  ``hold=False``: only look (the lock is let go)."""
    import fcntl

    path = study_lock(study_dir, uri)
    if path in _CLAIMS:
        return None
    try:
        path.parent.parent.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    if not private_folder(path.parent):
        return None
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip()
        os.close(fd)
        return int(holder) if holder.isdigit() else 0
    if not hold:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    _CLAIMS[path] = fd
    return None


def release_studies() -> None:
    """Let go of every study lock this process holds (:func:`claim_study`)."""
    while _CLAIMS:
        os.close(_CLAIMS.popitem()[1])


def forget_state(study_dir: Path, uri: str | None = None) -> None:
    """Remove the study's records of its Tune state (stale once Tune writes it again)."""
    state_record(study_dir, uri).unlink(missing_ok=True)


def _write(study_dir: Path, uri: str | None, sums: dict[str, str]) -> None:
    text = "".join(f"{digest}  {rel}\n" for rel, digest in sums.items())
    write_text_atomically(study_dir / STATE_SUMS, text)
    record = state_record(study_dir, uri)
    record.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_text_atomically(record, text)


def record_state(study_dir: Path, uri: str | None = None) -> None:
    """Write ``state.sha256`` (``<sha256>  <path>`` lines) for the current Tune state, in the study folder and
    in this user's private record (:func:`state_record`)."""
    _write(study_dir, uri, state_sums(study_dir))


def register_writer(study_dir: Path, driver: dict[str, str]) -> None:
    """Note in ``<study>/writers/`` that this process (a trial actor) writes the study's Tune state for the
    driver named by ``driver`` (:func:`~prvrlab.platform.tracking.drivers.driver_tags`): once that driver is
    killed, its sentinel records the state only after this process is gone too (:func:`record_settled`)."""
    me = driver_tags()
    folder = Path(study_dir) / WRITERS
    folder.mkdir(parents=True, exist_ok=True)
    name = f"{me[HOST_TAG]}.{me[PID_TAG]}.{me[START_TAG]}.json"
    write_text_atomically(folder / name, json.dumps({"writer": me, "driver": dict(driver)}))


def _writers(study_dir: Path) -> list[tuple[Path, dict[str, str], dict[str, str]]]:
    """The study's writer registrations: (file, the writer's tags, its driver's tags)."""
    found = []
    for path in sorted((Path(study_dir) / WRITERS).glob("*.json")):
        try:
            entry = json.loads(path.read_text(encoding="utf-8"))
            found.append((path, dict(entry["writer"]), dict(entry["driver"])))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return found


def live_writers(study_dir: Path, driver: dict[str, str]) -> list[dict[str, str]]:
    """The registered writers of ``driver`` that still run on this host (those of other hosts cannot be told)."""
    return [
        writer
        for _, writer, by in _writers(study_dir)
        if all(by.get(tag) == driver.get(tag) for tag in (HOST_TAG, PID_TAG, START_TAG)) and driver_alive(writer)
    ]


def forget_writers(study_dir: Path) -> None:
    """Remove the registrations of writers that are gone from this host (whichever driver they wrote for)."""
    for path, writer, _ in _writers(study_dir):
        if driver_alive(writer) is False:
            path.unlink(missing_ok=True)


def record_settled(
    study_dir: Path,
    *,
    driver: dict[str, str] | None = None,
    settle_s: float = 1.0,
    quiet_s: float = 3.0,
    timeout_s: float = 20.0,
    writers_timeout_s: float = 30.0,
    heartbeat: Callable[[], None] = lambda: None,
) -> bool:
    """:func:`record_state` of a killed driver's local study once its trial processes of this host are gone
    (``driver``'s :func:`register_writer` entries; Ray stops them a moment after their driver, and until then
    one may still write a checkpoint; waited for up to ``writers_timeout_s``) and the study has not changed
    for ``quiet_s`` (read every ``settle_s``: writers of other hosts); False, recording nothing, when it is
    still changing after ``timeout_s`` more or has no Tune state.  ``heartbeat`` is called at every reading
    (the sentinel touches its ledger: a resume waits while it is fresh)."""
    if driver is not None:
        until = time.monotonic() + writers_timeout_s
        while live_writers(study_dir, driver) and time.monotonic() < until:
            heartbeat()
            time.sleep(min(settle_s, 0.2))
    deadline = time.monotonic() + timeout_s
    before, since = state_sums(study_dir), time.monotonic()
    while time.monotonic() < deadline:
        heartbeat()
        time.sleep(settle_s)
        now = state_sums(study_dir)
        if now != before:
            before, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            if not now:
                return False
            _write(study_dir, None, now)
            forget_writers(study_dir)
            return True
    return False


def read_sums(path: Path) -> dict[str, str]:
    """The ``relative path -> sha256`` lines of a record or ``state.sha256`` file."""
    recorded = {}
    for line in path.read_text().splitlines():
        digest, _, rel = line.partition("  ")
        recorded[rel] = digest
    return recorded
