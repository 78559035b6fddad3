"""Whole-store checks of visual features (zero-frame videos, non-finite values) and of query features.

:func:`check_visual_features` scans every frame once, in chunks of the memory
map (BigFile) or per video (HDF5), and raises :class:`DataError` naming the
file, the video id and the row.  A clean result is remembered in the data
index cache (:mod:`prvrlab.data.index_cache`, kind ``finite``) with the
version of the file (inode, size, mtime) taken before the scan, so an
unchanged store is not rescanned and a store changed since (or during the
scan) is.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from prvrlab.data import index_cache
from prvrlab.data.errors import DataError
from prvrlab.data.features import VisualFeatures
from prvrlab.data.text import QueryFeatures

CHUNK_BYTES = 64 << 20
FINITE = "finite"  # the index_cache kind of a clean scan (no arrays: its version is what is remembered)


def _data_file(visual: VisualFeatures) -> Path:
    return visual.path / "feature.bin" if visual.format == "bigfile" else visual.path


def _version(path: Path) -> tuple[int, ...] | None:
    try:
        return index_cache.version(path)
    except OSError:
        return None


def zero_frame_videos(visual: VisualFeatures) -> list[str]:
    """Video ids listed with no frame, in store order."""
    return [v for v, n in visual.frame_counts().items() if n == 0]


def check_visual_features(visual: VisualFeatures, *, progress: bool | None = None, use_cache: bool = True) -> None:
    """Raise DataError for a zero-frame video or a NaN/inf value anywhere in ``visual``.

    ``progress`` (default: stderr is a TTY) prints one updating progress line.
    """
    empty = zero_frame_videos(visual)
    if empty:
        where = visual.path / "video2frames.txt" if visual.format == "bigfile" else visual.path
        raise DataError(f"{where}: video {empty[0]!r} has no frame ({len(empty)} zero-frame videos in total)")
    path = _data_file(visual)
    version = _version(path)
    if use_cache and version is not None and index_cache.load(FINITE, path, version, ()) is not None:
        return
    show = sys.stderr.isatty() if progress is None else progress
    if visual.format == "bigfile":
        _scan_bigfile(visual, path, show)
    else:
        _scan_videos(visual, show)
    if show:
        print(file=sys.stderr)
    if version is not None:
        index_cache.save(FINITE, path, version, [], {})


def _progress(show: bool, path: Path, done: int, total: int) -> None:
    if show:
        print(f"\rchecking {path.name} for NaN/inf: {100 * done // max(total, 1)}%", end="", file=sys.stderr, flush=True)


def _scan_bigfile(visual, path: Path, show: bool) -> None:
    step = max(1, CHUNK_BYTES // (4 * visual.dim))
    for start in range(0, visual.num_rows, step):
        # a chunk read, not a memory map: a map would keep every page of the file resident until the end
        count = min(step, visual.num_rows - start) * visual.dim
        chunk = np.fromfile(path, dtype="<f4", count=count, offset=start * visual.dim * 4).reshape(-1, visual.dim)
        bad = np.flatnonzero(~np.isfinite(chunk).all(axis=1))
        if bad.size:
            row = start + int(bad[0])
            videos = visual.videos_of_row(row)
            owner = repr(videos[0]) if videos else "(no video)"
            raise DataError(f"{path}: non-finite value (NaN/inf) in row {row}, a frame of video {owner}")
        _progress(show, path, min(start + step, visual.num_rows), visual.num_rows)


def _scan_videos(visual: VisualFeatures, show: bool) -> None:
    ids = visual.video_ids()
    for i, vid in enumerate(ids):
        bad = np.flatnonzero(~np.isfinite(visual.frames(vid)).all(axis=1))
        if bad.size:
            raise DataError(f"{visual.path}: non-finite value (NaN/inf) in video {vid!r}, row {int(bad[0])}")
        if i % 256 == 0:
            _progress(show, visual.path, i, len(ids))
    visual.close()


def check_query_features(queries: QueryFeatures, query_ids: list[str], *, progress: bool | None = None) -> None:
    """Raise DataError naming the file and the query id for a NaN/inf value in any token of ``query_ids``.

    ``progress`` (default: stderr is a TTY) prints one updating progress line.
    """
    show = sys.stderr.isatty() if progress is None else progress
    for i, qid in enumerate(query_ids):
        queries.tokens(qid)  # raises DataError on a non-finite value
        if i % 1024 == 0:
            _progress(show, queries.path, i, len(query_ids))
    if show:
        print(file=sys.stderr)
    queries.close()
