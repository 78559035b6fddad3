"""Indexes of data files, remembered per version of the files they describe.

Opening a collection walks metadata that does not change between runs: the
query HDF5 file's dataset names, shapes and byte offsets
(:mod:`prvrlab.data.h5index`), a BigFile's frame ids and video-to-frame lists
(:class:`~prvrlab.data.bigfile.BigFile`).  At TVR's size that is ~17 s and
~3 s in every process that opens the collection: the driver's data check,
then each DDP rank of a training run, or of every trial of a search.  What
they compute is saved here, under ``data-index`` in
:func:`prvrlab.cache.cache_root` (one ``<kind>-<hash of the resolved
path>.npz`` per data file or folder), with the version of the files it came
from: inode, size and mtime (ns) of each.  A process that finds an
index of the same version loads it (~0.1 s) instead; any other version is
indexed again and replaces it.  Only names, counts and offsets are kept,
never a feature value; files are read with ``allow_pickle=False``, so nothing
in them can run code, and an unreadable one is ignored.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path

import numpy as np

from prvrlab.cache import cache_root

FORMAT = 2  # bump when a saved layout changes: older files are then ignored
KEEP = 256  # indexes kept; the least recently used beyond that are deleted when one is saved


def index_dir() -> Path:
    """Where indexes are saved: ``data-index`` in :func:`prvrlab.cache.cache_root`."""
    return cache_root() / "data-index"


def index_file(kind: str, path: Path) -> Path:
    """The saved ``kind`` index of the data file or folder ``path``."""
    return index_dir() / f"{kind}-{hashlib.sha1(str(Path(path).resolve()).encode()).hexdigest()[:16]}.npz"


def stamp(st: os.stat_result) -> tuple[int, ...]:
    """What identifies one version of a file: inode, size, mtime and ctime (ns).  The ctime catches a
    rewrite in place whose old mtime was put back (``cp -p`` over the file, ``rsync -t --inplace``,
    ``touch -r``); nothing can set it back.  Not the device: a network file system's device number
    differs from node to node for the same file, and nodes sharing one cache folder (an NFS home) would
    each index it again and replace the others' index."""
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def version(*paths: Path) -> tuple[int, ...]:
    """The :func:`stamp` of each of ``paths``, one after the other."""
    return tuple(value for path in paths for value in stamp(os.stat(path)))


def load(kind: str, path: Path, stamp: tuple[int, ...], fields: tuple[str, ...]) -> tuple[list[str], dict[str, np.ndarray]] | None:
    """(names, ``fields``' arrays) saved for ``path`` at version ``stamp``; None when there are none, they
    describe another version or layout, lack a field, or cannot be read."""
    target = index_file(kind, path)
    try:
        with np.load(target, allow_pickle=False) as saved:
            if int(saved["format"]) != FORMAT or tuple(saved["stamp"].tolist()) != tuple(stamp):
                return None
            count = int(saved["count"])
            names = saved["names"].tobytes().decode("utf-8").split("\0") if count else []
            arrays = {name: saved[name] for name in fields}
    except Exception:  # noqa: BLE001 - missing, truncated, not a zip, a pickle, a field short...: indexed again
        return None
    if len(names) != count:
        return None
    with contextlib.suppress(OSError):
        os.utime(target)  # used now: kept by the pruning in save
    return names, arrays


def save(kind: str, path: Path, stamp: tuple[int, ...], names: list[str], arrays: dict[str, np.ndarray]) -> None:
    """Save ``names`` and ``arrays`` as the ``kind`` index of ``path`` at version ``stamp`` (atomically: a
    concurrent reader finds the old file or this one); a cache folder that cannot be written, or a name
    that is not valid UTF-8, leaves it unsaved."""
    target = index_file(kind, path)
    scratch: str | None = None
    try:
        joined = np.frombuffer("\0".join(names).encode("utf-8"), dtype=np.uint8)  # NUL: in no file or dataset name
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, scratch = tempfile.mkstemp(dir=target.parent, prefix=".tmp-", suffix=".npz")
        with os.fdopen(fd, "wb") as fh:
            np.savez(
                fh, format=np.int64(FORMAT), stamp=np.array(stamp, dtype=np.int64), count=np.int64(len(names)),
                names=joined, **arrays,
            )
        os.replace(scratch, target)
    except (OSError, UnicodeEncodeError):
        if scratch is not None:
            with contextlib.suppress(OSError):
                os.unlink(scratch)
        return
    prune(target.parent, KEEP)


def prune(folder: Path, keep: int) -> None:
    """Delete all but the ``keep`` most recently used indexes in ``folder`` (one per data file ever
    opened would otherwise pile up: synthetic collections written to temporary folders, old copies)."""
    with contextlib.suppress(OSError):
        entries = [(entry.stat().st_mtime_ns, entry.path) for entry in os.scandir(folder)
                   if entry.name.endswith(".npz") and not entry.name.startswith(".tmp-")]  # not a writer's scratch
        if len(entries) <= keep:
            return
        for _, stale in sorted(entries, reverse=True)[keep:]:
            with contextlib.suppress(OSError):
                os.unlink(stale)
