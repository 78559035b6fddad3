"""Captions, query token features and moment timestamps.

Files of a collection ``<c>`` under ``TextData/``:

- ``<c><split>.caption.txt``: one ``"<cap_id> <caption text>"`` per line, split
  on the first whitespace; the video of a caption is ``cap_id.split('#')[0]``.
- ``roberta_<c>_query_feat.hdf5``: one dataset per cap_id at the root,
  shape ``(n_tokens, Dq)``.
- ``<c><split>.timestamps.json`` (optional, analysis only): a JSON object
  ``{cap_id: [start_seconds, end_seconds, video_duration_seconds]}``.  The
  synthetic generator writes it; the public feature releases ship no moments,
  so ratios are ``None`` there until ``prvrlab data timestamps`` writes it from
  the dataset's own annotations (:mod:`prvrlab.data.moments`).
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Iterable

import numpy as np

from prvrlab.data.errors import DataError
from prvrlab.data.features import H5Arrays
from prvrlab.files import special_kind


def video_id_of(cap_id: str) -> str:
    """The video id of a caption id: everything before the first ``#``."""
    return cap_id.split("#", 1)[0]


def caption_path(text_dir: str | Path, collection: str, split: str) -> Path:
    """``TextData/<collection><split>.caption.txt``."""
    return Path(text_dir) / f"{collection}{split}.caption.txt"


def caption_splits(text_dir: str | Path, collection: str) -> list[str]:
    """The splits of ``collection`` that have a caption file: train, val, test first, then the rest."""
    suffix = ".caption.txt"
    names = {p.name[len(collection) : -len(suffix)] for p in Path(text_dir).glob(f"{collection}*{suffix}")}
    usual = [n for n in ("train", "val", "test") if n in names]
    return usual + sorted(names - set(usual))


def missing_split_message(text_dir: str | Path, collection: str, split: str) -> str:
    """Why split ``split`` cannot be read: the splits that exist, and the closest one."""
    text_dir = Path(text_dir)
    if not text_dir.is_dir():
        root = text_dir.parent
        where = f"{root} has no TextData folder" if root.is_dir() else f"the data root {root} does not exist"
        return f"split {split!r} not found: {where} (a data root holds TextData/ and FeatureData/)"
    known = caption_splits(text_dir, collection)
    if not known:
        others = sorted(p.name for p in text_dir.glob("*.caption.txt"))
        hint = f"; caption files there: {', '.join(others[:5])}{', ...' if len(others) > 5 else ''}" if others else ""
        return (f"split {split!r} not found: no caption file of collection {collection!r} in {text_dir} "
                f"(looked for {collection}{split}.caption.txt){hint}")
    close = difflib.get_close_matches(split, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"split {split!r} not found in {text_dir}; splits with captions: {', '.join(known)}{hint}"


def not_a_regular_file(path: Path) -> str:
    """Why ``path``, which exists, cannot be read as a text file: what kind of file it is."""
    return f"{path}: is {special_kind(path) or 'not a regular file'}, expected a regular text file"


def timestamps_path(text_dir: str | Path, collection: str, split: str) -> Path:
    """``TextData/<collection><split>.timestamps.json``."""
    return Path(text_dir) / f"{collection}{split}.timestamps.json"


def read_captions(path: str | Path) -> list[tuple[str, str]]:
    """``[(cap_id, caption_text), ...]`` in file order; blank lines are skipped.

    Lines end in ``\\n``, ``\\r\\n`` or a lone ``\\r`` (old Mac files), as Python's text mode reads
    them (the reference's ``open(cap_file)``); a UTF-8 byte-order mark at the start is not part of the
    first cap_id.  Raises DataError naming the file for a missing file or a repeated cap_id, and the
    line for text that is not UTF-8.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(not_a_regular_file(path) if path.exists() else f"caption file not found: {path}")
    out: list[tuple[str, str]] = []
    data = path.read_bytes().removeprefix(b"\xef\xbb\xbf")
    if b"\r" in data:
        data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    for number, raw in enumerate(data.split(b"\n"), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            byte = f"byte 0x{raw[exc.start]:02x} at column {exc.start + 1}"
            raise DataError(f"{path}: line {number}: not UTF-8 text ({byte})") from None
        parts = line.strip().split(None, 1)
        if parts:
            out.append((parts[0], parts[1] if len(parts) > 1 else ""))
    if len({c for c, _ in out}) != len(out):
        seen: set[str] = set()
        for cap_id, _ in out:
            if cap_id in seen:
                raise DataError(f"{path}: caption id {cap_id!r} appears more than once")
            seen.add(cap_id)
    return out


class QueryFeatures:
    """Query token features: an HDF5 file with one (n_tokens, Dq) dataset per cap_id.

    ``dim`` comes from the first dataset; :meth:`check` validates a set of
    cap_ids (presence is set-based, shapes are a metadata-only scan) and
    :meth:`tokens` re-checks the shape of what it reads.
    """

    def __init__(self, path: str | Path) -> None:
        self._arrays = H5Arrays(path, what="query features")
        self.path = self._arrays.path
        keys = self._arrays.keys()
        if not keys:
            raise DataError(f"{self.path}: the query feature file holds no query")
        self._first = keys[0]
        self._dim = int(self._arrays.shapes([self._first])[0, 1])
        self._arrays.close()

    @property
    def dim(self) -> int:
        """Token feature dimension Dq."""
        return self._dim

    def __len__(self) -> int:
        return len(self._arrays)

    def __contains__(self, cap_id: str) -> bool:
        return cap_id in self._arrays

    def missing(self, cap_ids: Iterable[str]) -> list[str]:
        """The cap_ids without a dataset, in the given order."""
        return self._arrays.missing(cap_ids)

    def check(self, cap_ids: list[str], *, source: str | Path | None = None) -> np.ndarray:
        """Validate ``cap_ids`` and return their token counts (n,) int64.

        Raises DataError naming this file and the cap_id when one is missing
        (and ``source``, the caption file, when given), has a dimension other
        than :attr:`dim`, or has no token.
        """
        missing = self.missing(cap_ids)
        if missing:
            where = f" (captions: {source})" if source is not None else ""
            raise DataError(
                f"{self.path}: query id {missing[0]!r} has no features{where}; "
                f"{len(missing)} of {len(cap_ids)} query ids are missing"
            )
        shapes = self._arrays.shapes(cap_ids)  # (n, 2)
        bad = np.flatnonzero(shapes[:, 1] != self._dim)
        if bad.size:
            i = int(bad[0])
            raise DataError(
                f"{self.path}: query {cap_ids[i]!r} has dimension {shapes[i, 1]}, "
                f"but query {self._first!r} has {self._dim}"
            )
        empty = np.flatnonzero(shapes[:, 0] == 0)
        if empty.size:
            raise DataError(f"{self.path}: query {cap_ids[int(empty[0])]!r} has no token")
        return shapes[:, 0].copy()

    def tokens(self, cap_id: str, *, max_len: int | None = None) -> np.ndarray:
        """Token features of ``cap_id``, (n_tokens, Dq) float32: only its first ``max_len`` tokens when given.

        Raises DataError naming this file and ``cap_id`` for a wrong shape or a NaN/inf value in what is read.
        """
        out = self._arrays.read(cap_id, max_rows=max_len)  # (n, Dq)
        if out.shape[1] != self._dim or out.shape[0] == 0:
            raise DataError(f"{self.path}: query {cap_id!r} has shape {out.shape}, expected (n >= 1, {self._dim})")
        if not np.isfinite(out).all():
            row = int(np.flatnonzero(~np.isfinite(out).all(axis=1))[0])
            raise DataError(f"{self.path}: non-finite value (NaN/inf) in query {cap_id!r}, token {row}")
        return out

    def close(self) -> None:
        """Close this process's HDF5 handle."""
        self._arrays.close()

    def __repr__(self) -> str:
        return f"QueryFeatures({str(self.path)!r}, queries={len(self)}, dim={self._dim})"


def checked_number(value, path: Path, where: str) -> float:
    """``value`` (an annotation's field) as a finite float; DataError naming the file and ``where`` otherwise."""
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise DataError(f"{path}: {where}: expected a number, got {value!r}") from None
    if out != out or out in (float("inf"), float("-inf")):
        raise DataError(f"{path}: {where}: expected a finite number, got {value!r}")
    return out


def checked_moment(start, end, duration, path: Path, where: str) -> tuple[float, float, float]:
    """(start, end, duration) as numbers, refused when no moment: negative start, end before start, a video
    of no length (an end past the video's length is kept: its ratio counts as 1)."""
    s, e, d = checked_number(start, path, where), checked_number(end, path, where), checked_number(duration, path, where)
    if d <= 0 or s < 0 or e < s:
        raise DataError(f"{path}: {where}: not a moment: start {s:g}, end {e:g} in a video of {d:g} s")
    return s, e, d


def read_timestamps(path: str | Path, *, skipped: list[str] | None = None) -> dict[str, tuple[float, float, float]] | None:
    """``{cap_id: (start, end, duration)}`` from a timestamps file, or None if absent; DataError naming the file
    and the query for an entry that is not a moment (:func:`checked_moment`), or with ``skipped`` given, that
    entry left out and why appended to it."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise DataError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise DataError(f"{path}: expected a JSON object {{cap_id: [start, end, duration]}}")
    out: dict[str, tuple[float, float, float]] = {}
    for cap_id, value in raw.items():
        numbers = isinstance(value, list) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
        if not (numbers and len(value) == 3):
            raise DataError(f"{path}: query {cap_id!r}: expected [start, end, duration], got {value!r}")
        try:
            out[cap_id] = checked_moment(*value, path, f"query {cap_id!r}")
        except DataError as exc:
            if skipped is None:
                raise
            skipped.append(str(exc).removeprefix(f"{path}: "))  # left out: its query is in no ratio group
    return out


def write_timestamps(path: str | Path, timestamps: dict[str, tuple[float, float, float]]) -> None:
    """Write ``{cap_id: (start, end, duration)}`` as a timestamps JSON file."""
    data = {k: [round(float(x), 4) for x in v] for k, v in timestamps.items()}
    Path(path).write_text(json.dumps(data, separators=(",", ":")), encoding="utf-8")


def moment_ratios(timestamps: dict[str, tuple[float, float, float]], cap_ids: list[str]) -> np.ndarray:
    """Moment / video duration ratio per cap_id, (n,) float64 in [0, 1]; NaN when unknown."""
    t = np.array([timestamps.get(c, (np.nan, np.nan, np.nan)) for c in cap_ids], dtype=np.float64).reshape(-1, 3)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = (t[:, 1] - t[:, 0]) / t[:, 2]  # (n,)
    return np.clip(r, 0.0, 1.0)
