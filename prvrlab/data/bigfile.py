"""Reader for the BigFile folders of the public PRVR feature releases.

A BigFile folder holds every frame of every video in one matrix:

- ``feature.bin``: raw little-endian float32, row-major, ``N x D``;
- ``shape.txt``: one line ``"N D"``;
- ``id.txt``: ``N`` whitespace-separated frame ids (latin-1), one per row;
- ``video2frames.txt``: a Python dict literal ``{video_id: [frame_id, ...]}``, UTF-8 as the official
  reader's ``open()`` and the captions (latin-1 when it is not valid UTF-8); its frame ids are matched to
  ``id.txt``'s by their bytes.

The folder is validated once on open and every frame id is mapped to its row
once.  A video whose rows are one ascending run of ``feature.bin`` (the
usual layout) is read by one positioned read (``os.preadv``) straight into
its array: the file's pages stay in the page cache, not in this process's
resident set (a memory map keeps every page it has touched resident, which
made RSS grow by every video read in an epoch or an evaluation).  Other
videos are one fancy-index gather from a memory map (no per-frame seek, no
per-frame list).
"""

from __future__ import annotations

import ast
import json
import os
from itertools import chain, repeat
from pathlib import Path

import numpy as np

from prvrlab.data import index_cache
from prvrlab.data.errors import DataError

FILES = ("feature.bin", "shape.txt", "id.txt", "video2frames.txt")
# its index_cache entries: what id.txt and video2frames.txt say, per version of the four files; "-2" since repeated
# ids are refused (an index cached before would open such a folder without the check), "-3" since video2frames.txt
# is read as UTF-8 (an index cached before holds a non-ASCII video id as latin-1 had decoded it)
INDEX_KIND = "bigfile-3"


def read_shape(path: Path) -> tuple[int, int]:
    """Parse ``shape.txt`` (``"N D"``) into ``(N, D)``."""
    try:
        parts = path.read_text(encoding="latin-1").split()
        n, d = (int(p) for p in parts)
    except ValueError:
        raise DataError(f"{path}: expected one line 'N D' with two integers") from None
    if n < 0 or d < 1:
        raise DataError(f"{path}: invalid shape N={n} D={d}")
    return n, d


def read_frame_ids(path: Path) -> list[str]:
    """Whitespace-separated frame ids of ``id.txt``, decoded as latin-1.

    Split on ASCII whitespace only (bytes.split), so latin-1 characters such
    as NBSP stay part of an id.
    """
    return list(map(bytes.decode, path.read_bytes().split(), repeat("latin-1")))


def _first_repeat(items: list) -> object:
    """The first item of ``items`` seen before in it (the caller knows there is one)."""
    seen: set = set()
    return next(x for x in items if x in seen or seen.add(x))


def _shown(frame_id: str) -> str:
    """A frame id as its file spells it: id.txt is read as latin-1, so a UTF-8 id reads as 'cafÃ©' there."""
    try:
        return frame_id.encode("latin-1").decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        return frame_id


class _Pairs(list):
    """A JSON object's (key, value) pairs in file order (``json.loads``' ``object_pairs_hook``): repeats kept."""


def read_video2frames(path: Path) -> dict[str, list[str]]:
    """Parse ``video2frames.txt``, a Python dict literal, as data (never ``eval``).

    The text is parsed by :func:`ast.literal_eval`.  Fast path: when it holds
    no backslash and no double quote, every single quote delimits a string, so
    swapping the quotes gives JSON that :func:`json.loads` reads to exactly
    the same dict about 20x faster and without building a syntax tree (TVR:
    0.3 s instead of 6 s and 2 GB); any JSON error falls back to literal_eval.
    """
    raw = path.read_bytes()
    try:  # video ids as the captions read them (UTF-8); a file that is not UTF-8: latin-1, byte for byte
        text = raw.decode("utf-8").strip()
        recode = not text.isascii()
    except UnicodeDecodeError:
        text, recode = raw.decode("latin-1").strip(), False
    mapping, keys = None, None
    if "\\" not in text and '"' not in text:
        try:
            pairs = json.loads(text.replace("'", '"'), object_pairs_hook=_Pairs)
        except ValueError:
            pairs = None
        except RecursionError as exc:
            raise DataError(f"{path}: not a Python dict literal (RecursionError: {exc})") from None
        if isinstance(pairs, _Pairs):  # a JSON object
            keys, mapping = [k for k, _ in pairs], {k: dict(v) if isinstance(v, _Pairs) else v for k, v in pairs}
    if mapping is None:
        try:
            tree = ast.parse(text, mode="eval")
            mapping = ast.literal_eval(tree)
        except (ValueError, SyntaxError, MemoryError, RecursionError) as exc:
            raise DataError(f"{path}: not a Python dict literal ({type(exc).__name__}: {exc})") from None
        if isinstance(tree.body, ast.Dict):
            keys = [k.value if isinstance(k, ast.Constant) else None for k in tree.body.keys]
    if keys is not None and isinstance(mapping, dict) and len(keys) != len(mapping):  # eval keeps the last entry
        twice = _first_repeat(keys)
        raise DataError(f"{path}: video {twice!r} is listed {keys.count(twice)} times; each video must be listed once")
    if not isinstance(mapping, dict):
        raise DataError(f"{path}: expected a dict {{video_id: [frame_id, ...]}}, got {type(mapping).__name__}")
    key_types = set(map(type, mapping))
    value_types = set(map(type, mapping.values()))
    frame_types = set(map(type, chain.from_iterable(mapping.values()))) if value_types <= {list, tuple} else set()
    if not (key_types <= {str} and value_types <= {list, tuple} and frame_types <= {str}):
        vid, frames = next((k, v) for k, v in mapping.items() if not _valid_entry(k, v))
        raise DataError(f"{path}: entry {vid!r}: expected a str video id -> list of str frame ids, got {frames!r:.80}")
    if recode:  # frame ids as id.txt's latin-1 reading of the same bytes
        mapping = {vid: [f.encode("utf-8").decode("latin-1") for f in frames] for vid, frames in mapping.items()}
    return mapping


def _valid_entry(video_id: object, frames: object) -> bool:
    return (
        isinstance(video_id, str)
        and isinstance(frames, (list, tuple))
        and all(isinstance(f, str) for f in frames)
    )


def read_float32(fd: int, offset: int, shape: tuple[int, int], *, short: str) -> np.ndarray:
    """A (rows, cols) little-endian float32 array read by positioned reads from byte ``offset`` of the
    open file ``fd``; DataError(``short``) when the file ends first."""
    out = np.empty(shape, dtype="<f4")  # (rows, cols)
    view, done = memoryview(out).cast("B"), 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise DataError(short)
        done += n
    return out.astype(np.float32, copy=False)


class BigFile:
    """Memory-mapped BigFile folder implementing the ``VisualFeatures`` interface.

    Picklable: the memory map is dropped when pickled and reopened lazily, so
    the object can be sent to DataLoader workers or Ray actors.
    """

    format = "bigfile"

    def __init__(self, folder: str | Path) -> None:
        self.path = Path(folder)
        if self.path.exists() and not self.path.is_dir():
            raise DataError(f"{self.path}: not a folder; a BigFile is a folder (feature.bin, shape.txt, id.txt, video2frames.txt)")
        if not self.path.is_dir():
            raise DataError(f"BigFile folder not found: {self.path}")
        for name in FILES:
            if not (self.path / name).is_file():
                raise DataError(f"BigFile {self.path}: missing file {self.path / name}")
        n, d = read_shape(self.path / "shape.txt")
        if n == 0:
            raise DataError(f"{self.path / 'shape.txt'}: the BigFile holds no frames (N=0)")
        bin_path = self.path / "feature.bin"
        size = bin_path.stat().st_size
        if size != n * d * 4:
            raise DataError(
                f"{bin_path}: size {size} bytes disagrees with shape.txt ({n} x {d} float32 = {n * d * 4} bytes)"
            )
        self._num_rows, self._dim = n, d
        stamp = index_cache.version(*(self.path / name for name in FILES))
        if not self._adopt(index_cache.load(INDEX_KIND, self.path, stamp, ("offsets", "rows", "contiguous"))):
            self._index_files()
            self._save_index(stamp)
        self._mm: np.memmap | None = None
        self._fd: int | None = None

    def _index_files(self) -> None:
        """Video ids, frame offsets, rows and runs from ``id.txt`` and ``video2frames.txt``."""
        n = self._num_rows
        ids = read_frame_ids(self.path / "id.txt")
        if len(ids) != n:
            raise DataError(f"{self.path / 'id.txt'}: {len(ids)} frame ids, but shape.txt says N={n}")
        v2f_path = self.path / "video2frames.txt"
        v2f = read_video2frames(v2f_path)
        self._video_ids = list(v2f)
        self._index = {vid: i for i, vid in enumerate(self._video_ids)}
        counts = np.fromiter(map(len, v2f.values()), dtype=np.int64, count=len(v2f))
        self._offsets = np.zeros(len(v2f) + 1, dtype=np.int64)
        np.cumsum(counts, out=self._offsets[1:])
        row_of = dict(zip(ids, range(n)))
        if len(row_of) != n:  # the official reader would take the last row of a repeated id: ambiguous features
            twice = _first_repeat(ids)
            raise DataError(f"{self.path / 'id.txt'}: frame id {_shown(twice)!r} names {ids.count(twice)} rows of feature.bin "
                            f"({n - len(row_of)} repeated ids in total); each frame id must name one row")
        flat = list(chain.from_iterable(v2f.values()))
        self._rows = np.fromiter(map(row_of.get, flat, repeat(-1)), dtype=np.int64, count=len(flat))
        missing = np.flatnonzero(self._rows < 0)
        if missing.size:
            first = int(missing[0])
            vid = self._video_ids[int(np.searchsorted(self._offsets, first, side="right")) - 1]
            raise DataError(
                f"{v2f_path}: frame id {_shown(flat[first])!r} of video {vid!r} is not in {self.path / 'id.txt'} "
                f"({missing.size} unknown frame ids in total)"
            )
        # (F + 1,) consecutive row pairs so far; the extra entry serves a trailing video without frames
        step_ok = np.concatenate([[0], np.cumsum(np.diff(self._rows) == 1), [0]])
        lasts = np.maximum(self._offsets[1:] - 1, self._offsets[:-1])  # (V,) last frame position (first if none)
        # a video's rows are one ascending run of feature.bin: read as one slice
        self._contiguous = step_ok[lasts] - step_ok[self._offsets[:-1]] == lasts - self._offsets[:-1]  # (V,)

    def _save_index(self, stamp: tuple[int, ...]) -> None:
        """Save the tables of :meth:`_index_files` for the next opening of this version (index_cache)."""
        arrays = {"offsets": self._offsets, "rows": self._rows, "contiguous": self._contiguous}
        index_cache.save(INDEX_KIND, self.path, stamp, self._video_ids, arrays)

    def _adopt(self, found: tuple[list[str], dict[str, np.ndarray]] | None) -> bool:
        """Take the tables of :meth:`_index_files` from a saved index of this version of the folder;
        False when there is none or it does not fit this folder's shape."""
        if found is None:
            return False
        video_ids, saved = found
        offsets, rows, contiguous = saved["offsets"], saved["rows"], saved["contiguous"]
        V = len(video_ids)
        fits = (
            offsets.shape == (V + 1,) and contiguous.shape == (V,) and contiguous.dtype == bool
            and offsets.dtype.kind == rows.dtype.kind == "i"
            and offsets[0] == 0 and bool((np.diff(offsets) >= 0).all())  # (V + 1,) rising from 0
            and rows.shape == (int(offsets[-1]),) and bool(((rows >= 0) & (rows < self._num_rows)).all())  # (F,)
        )
        if not fits:
            return False
        offsets, rows = offsets.astype(np.int64), rows.astype(np.int64)
        self._video_ids, self._offsets, self._rows, self._contiguous = video_ids, offsets, rows, contiguous
        self._index = {vid: i for i, vid in enumerate(video_ids)}
        return True

    @property
    def dim(self) -> int:
        """Feature dimension D."""
        return self._dim

    @property
    def num_rows(self) -> int:
        """Number of frame rows N in ``feature.bin``."""
        return self._num_rows

    def __len__(self) -> int:
        return len(self._video_ids)

    def video_ids(self) -> list[str]:
        """Every video id of ``video2frames.txt``, in file order."""
        return list(self._video_ids)

    def has(self, video_id: str) -> bool:
        """Whether ``video_id`` has an entry in ``video2frames.txt``."""
        return video_id in self._index

    def num_frames(self, video_id: str) -> int:
        """Number of frames of ``video_id``."""
        i = self._position(video_id)
        return int(self._offsets[i + 1] - self._offsets[i])

    def frame_counts(self) -> dict[str, int]:
        """Frames per video, for every video."""
        return dict(zip(self._video_ids, np.diff(self._offsets).tolist()))

    def frames(self, video_id: str) -> np.ndarray:
        """The frames of ``video_id`` in ``video2frames.txt`` order, (n, D) float32."""
        i = self._position(video_id)
        rows = self._rows[self._offsets[i] : self._offsets[i + 1]]  # (n,)
        if self._contiguous[i] and rows.size:  # one sequential read instead of a gather
            return self._read_run(int(rows[0]), int(rows.size))  # (n, D)
        return np.asarray(self._memmap()[rows], dtype=np.float32)  # (n, D)

    def _read_run(self, start: int, count: int) -> np.ndarray:
        """Rows ``start .. start + count - 1`` of ``feature.bin``, (count, D) float32, by positioned reads."""
        if not hasattr(os, "preadv"):  # not on this OS: a slice of the memory map
            return np.array(self._memmap()[start : start + count], dtype=np.float32)
        if self._fd is None:
            self._fd = os.open(self.path / "feature.bin", os.O_RDONLY)
        return read_float32(self._fd, start * self._dim * 4, (count, self._dim),
                            short=f"{self.path / 'feature.bin'}: ends before row {start + count} (shape.txt says more)")

    def videos_of_row(self, row: int) -> list[str]:
        """The video ids whose frames include row ``row`` of ``feature.bin``."""
        positions = np.flatnonzero(self._rows == row)
        owners = np.searchsorted(self._offsets, positions, side="right") - 1
        return [self._video_ids[int(i)] for i in dict.fromkeys(owners.tolist())]

    def close(self) -> None:
        """Drop the memory map and the file descriptor (reopened on the next read)."""
        self._mm = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)

    def _position(self, video_id: str) -> int:
        try:
            return self._index[video_id]
        except KeyError:
            raise DataError(f"{self.path / 'video2frames.txt'}: no video {video_id!r}") from None

    def _memmap(self) -> np.memmap:
        if self._mm is None:
            self._mm = np.memmap(
                self.path / "feature.bin", dtype="<f4", mode="r", shape=(self._num_rows, self._dim)
            )
        return self._mm

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_mm"] = None
        state["_fd"] = None  # a worker process opens its own
        return state

    def __repr__(self) -> str:
        return f"BigFile({str(self.path)!r}, videos={len(self)}, frames={self._num_rows}, dim={self._dim})"
