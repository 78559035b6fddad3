"""Visual feature stores behind one interface, and the HDF5 array reader.

Two on-disk formats hold per-video frame features:

- a BigFile folder (:mod:`prvrlab.data.bigfile`), the format of the original
  TVR / ActivityNet / Charades releases;
- an HDF5 file with one dataset per video id at the root, shape
  ``(n_frames, D)`` (newer CLIP releases, or :func:`prvrlab.data.convert.convert_bigfile`).

:func:`open_visual_features` picks the reader from the path (folder or file).
Both readers are safe to pickle into DataLoader workers or Ray actors: HDF5
handles are opened lazily per process and never pickled.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Protocol, runtime_checkable

import h5py
import numpy as np

from prvrlab.data.bigfile import BigFile, read_float32
from prvrlab.data.errors import DataError
from prvrlab.data.h5index import UNKNOWN, H5Index
from prvrlab.data.index_cache import stamp


@runtime_checkable
class VisualFeatures(Protocol):
    """Per-video frame features, whatever the storage format."""

    path: Path
    format: str  # "bigfile" | "hdf5"

    @property
    def dim(self) -> int:
        """Feature dimension D."""

    def __len__(self) -> int: ...

    def video_ids(self) -> list[str]:
        """Every stored video id."""

    def has(self, video_id: str) -> bool:
        """Whether features for ``video_id`` are stored."""

    def num_frames(self, video_id: str) -> int:
        """Number of frames of ``video_id``."""

    def frame_counts(self) -> dict[str, int]:
        """Frames per video, for every stored video."""

    def frames(self, video_id: str) -> np.ndarray:
        """Frames of ``video_id``, (n, D) float32."""

    def close(self) -> None:
        """Release open handles (they are reopened on demand)."""


class H5Arrays:
    """An HDF5 file holding one 2-D dataset per key at its root.

    The key list is read once on construction; the file handle is opened on
    first read in each process (tracked by pid) and dropped when pickled.
    The names, shapes and runs below are saved per version of the file
    (:mod:`prvrlab.data.h5index`), so another process opening the same
    version reads them instead of walking the file.
    ``what`` names the content in error messages ("query features", ...).

    :meth:`shapes` also notes where each contiguous little-endian float32
    dataset's values lie in the file (HDF5 stores such a dataset as one run of
    bytes, unfiltered); :meth:`read` then reads that run with one positioned
    read (~9 us) instead of opening the dataset through HDF5 (~70 us): a TVR
    test evaluation reads 10,895 queries, a training epoch 87k.  A file that
    is not the one measured (inode, size or mtime differ) is read
    through HDF5 again.
    """

    def __init__(self, path: str | Path, *, what: str = "features") -> None:
        self.path = Path(path)
        self.what = what
        if not self.path.is_file():
            raise DataError(f"{what} file not found: {self.path}")
        listed = stamp(os.stat(self.path))
        index = H5Index.load(self.path, listed)  # this version's saved names, shapes and runs (h5index)
        if index is None:
            try:
                with h5py.File(self.path, "r") as f:
                    index = H5Index(keys=list(f.keys()), stamp=listed)
            except (OSError, RuntimeError) as exc:  # RuntimeError: a damaged B-tree or heap (h5py)
                raise DataError(f"{self.path}: cannot open as HDF5 ({exc})") from None
        self._index = index
        self._keys = index.keys
        self._handle: h5py.File | None = None
        self._pid = -1
        self._runs: dict[str, tuple[int, int, int]] = {}  # key -> (byte offset, rows, cols) of a float32 run
        self._stamp: tuple[int, ...] | None = None  # the file the runs were measured in
        self._fd: int | None = None
        self._fd_pid = -1

    def keys(self) -> list[str]:
        """Every dataset name at the root, in h5py's order: by name, unless the file was written with
        ``track_order=True`` (then in creation order)."""
        return list(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: str) -> bool:
        return key in self._index.position

    def missing(self, keys: Iterable[str]) -> list[str]:
        """The keys (in the given order) that have no dataset in the file."""
        position = self._index.position
        return [k for k in keys if k not in position]

    def shapes(self, keys: Iterable[str] | None = None) -> np.ndarray:
        """(n, 2) int64 shapes of the datasets ``keys`` (default: all), metadata only.

        Shapes measured before, in this process or (same version of the file) in the saved
        :class:`~prvrlab.data.h5index.H5Index`, are not measured again; new ones are saved.
        Raises DataError naming the file and key for a missing key or a dataset that is not 2-D.
        """
        keys = self._keys if keys is None else list(keys)
        if self._stamp is None:
            self._stamp = stamp(os.stat(self.path))
        index = self._index
        if index.stamp != self._stamp:  # replaced since it was listed: measured afresh and not saved
            index = H5Index(keys=self._keys, stamp=self._stamp)
        position = index.position
        at = np.fromiter((position.get(k, UNKNOWN) for k in keys), dtype=np.int64, count=len(keys))  # (n,)
        absent = np.flatnonzero(at == UNKNOWN)
        known = at[: absent[0]] if absent.size else at  # keys before the first missing one are checked first
        todo = index.unknown(known)
        if todo.size:
            try:
                self._measure(index, todo)
            finally:  # what was measured before a bad dataset is kept too
                if index is self._index and index.unknown(todo).size < todo.size:
                    index.save(self.path)
        if absent.size:
            self._dataset(self._file().id, keys[int(absent[0])])  # raises DataError naming the key
        out = index.shapes[at]  # (n, 2)
        offsets = index.offsets[at]  # (n,)
        hit = np.flatnonzero(offsets != UNKNOWN)
        runs = zip(hit.tolist(), offsets[hit].tolist(), out[hit].tolist())
        self._runs.update({keys[i]: (offset, rows, cols) for i, offset, (rows, cols) in runs})
        return out

    def _measure(self, index: H5Index, positions: np.ndarray) -> None:
        """Fill ``index``'s shape and float32-run offset of the datasets at ``positions``, in order, through HDF5."""
        fid = self._file().id
        for p in positions.tolist():
            key = index.keys[p]
            dsid = self._dataset(fid, key)
            shape = self._checked_shape(dsid, key)
            offset = dsid.get_offset()  # None unless contiguous (so unfiltered) and allocated
            f32 = offset is not None and dsid.get_storage_size() == 4 * shape[0] * shape[1] and dsid.get_type().equal(_F32)
            index.shapes[p] = shape
            index.offsets[p] = int(offset) if f32 else UNKNOWN

    def read(self, key: str, *, max_rows: int | None = None) -> np.ndarray:
        """The dataset ``key`` as a float32 array (n, D), only its first ``max_rows`` rows when given."""
        run = self._runs.get(key)
        if run is not None and self._raw_fd() is not None:
            offset, rows, cols = run
            rows = rows if max_rows is None else min(rows, max_rows)
            return read_float32(self._fd, offset, (rows, cols), short=f"{self.path}: ends inside dataset {key!r}")
        dsid = self._dataset(self._file().id, key)
        shape = self._checked_shape(dsid, key)
        rows = shape[0] if max_rows is None else min(shape[0], max_rows)
        out = np.empty((rows, shape[1]), dtype=np.float32)  # (n, D)
        try:
            if out.size and rows == shape[0]:
                dsid.read(h5py.h5s.ALL, h5py.h5s.ALL, out)
            elif out.size:  # the first rows only
                space = dsid.get_space()
                space.select_hyperslab((0, 0), out.shape)
                dsid.read(h5py.h5s.create_simple(out.shape), space, out)
        except (OSError, RuntimeError) as exc:  # a corrupt chunk, a failing filter: h5py names neither file nor dataset
            raise DataError(f"{self.path}: cannot read dataset {key!r} ({exc})") from None
        return out

    def _checked_shape(self, dsid, key: str) -> tuple[int, int]:
        """The (n, D) shape of dataset ``key``; DataError naming the file and key when it is not 2-D with D >= 1,
        not numeric, or declares more values than :data:`MAX_ELEMENTS` or (stored unfiltered) than the file holds."""
        shape = dsid.shape
        if shape is None:  # a null dataspace (h5py.Empty)
            raise DataError(f"{self.path}: dataset {key!r} has no shape (an empty dataspace), expected (n, D)")
        if len(shape) != 2:
            raise DataError(f"{self.path}: dataset {key!r} has shape {shape}, expected (n, D)")
        n, d = (int(x) for x in shape)
        if d < 1:
            raise DataError(f"{self.path}: dataset {key!r}: invalid shape N={n} D={d}")
        dtype = dsid.get_type()
        if dtype.get_class() not in (h5py.h5t.FLOAT, h5py.h5t.INTEGER):
            raise DataError(f"{self.path}: dataset {key!r} holds {dsid.dtype} values, expected numbers (float or int)")
        nbytes = n * d * dtype.get_size()
        if n * d > MAX_ELEMENTS:
            raise DataError(f"{self.path}: dataset {key!r} declares shape ({n}, {d}), more than {MAX_ELEMENTS} values")
        if nbytes > self._file().id.get_filesize() and dsid.get_create_plist().get_nfilters() == 0:
            raise DataError(
                f"{self.path}: dataset {key!r} declares shape ({n}, {d}) ({nbytes} bytes), "
                "more than the file holds (uncompressed)"
            )
        return n, d

    def close(self) -> None:
        """Close this process's handle and descriptor (reopened on the next read)."""
        if self._handle is not None and self._pid == os.getpid():
            self._handle.close()
        self._handle = None
        if self._fd is not None and self._fd_pid == os.getpid():
            os.close(self._fd)
        self._fd = None

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None and self._fd_pid == os.getpid():
            os.close(self._fd)

    def _raw_fd(self) -> int | None:
        """This process's descriptor of the file, or None (no positioned reads on this OS, or the file
        is not the one whose runs :meth:`shapes` noted: they are forgotten)."""
        if self._fd is not None and self._fd_pid == os.getpid():
            return self._fd
        if not hasattr(os, "preadv"):
            return None
        fd = os.open(self.path, os.O_RDONLY)
        if stamp(os.fstat(fd)) != self._stamp:
            os.close(fd)
            self._runs.clear()
            return None
        self._fd, self._fd_pid = fd, os.getpid()
        return fd

    def _dataset(self, fid, key: str):
        try:
            return h5py.h5d.open(fid, key.encode("utf-8"))
        except (KeyError, ValueError, TypeError):
            raise DataError(f"{self.path}: no dataset {key!r} in the {self.what} file") from None
        except (OSError, RuntimeError) as exc:  # a damaged B-tree or object header: h5py names neither
            raise DataError(f"{self.path}: cannot open dataset {key!r}, the file is damaged ({exc})") from None

    def _file(self) -> h5py.File:
        if self._handle is None or self._pid != os.getpid():
            # A handle inherited through fork belongs to the parent: never reuse it.
            self._handle = h5py.File(self.path, "r")
            self._pid = os.getpid()
        return self._handle

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_handle"] = None
        state["_pid"] = -1
        state["_fd"] = None  # a worker process opens its own
        state["_fd_pid"] = -1
        return state

    def __repr__(self) -> str:
        return f"H5Arrays({str(self.path)!r}, datasets={len(self)})"


_F32 = h5py.h5t.IEEE_F32LE
MAX_ELEMENTS = 1 << 31  # values one video's or one query's dataset may declare (8 GiB of float32)


class HDF5Features:
    """Visual features in HDF5, one dataset (n_frames, D) per video id.

    Every dataset's shape is checked on open (metadata only): all must be
    2-D with the same D, else DataError naming the file and the video id.
    """

    format = "hdf5"

    def __init__(self, path: str | Path) -> None:
        self._arrays = H5Arrays(path, what="visual features")
        self.path = self._arrays.path
        ids = self._arrays.keys()
        if not ids:
            raise DataError(f"{self.path}: the visual feature file holds no video")
        shapes = self._arrays.shapes(ids)  # (V, 2)
        self._arrays.close()
        bad = np.flatnonzero(shapes[:, 1] != shapes[0, 1])
        if bad.size:
            i = int(bad[0])
            raise DataError(
                f"{self.path}: video {ids[i]!r} has dimension {shapes[i, 1]}, "
                f"but video {ids[0]!r} has {shapes[0, 1]}"
            )
        self._dim = int(shapes[0, 1])
        self._counts = dict(zip(ids, shapes[:, 0].tolist()))

    @property
    def dim(self) -> int:
        """Feature dimension D."""
        return self._dim

    def __len__(self) -> int:
        return len(self._counts)

    def video_ids(self) -> list[str]:
        """Every video id (dataset name), in h5py's order (by name unless written with ``track_order``);
        a split's videos follow its caption file, not this."""
        return list(self._counts)

    def has(self, video_id: str) -> bool:
        """Whether a dataset named ``video_id`` exists."""
        return video_id in self._counts

    def num_frames(self, video_id: str) -> int:
        """Number of frames of ``video_id``."""
        try:
            return self._counts[video_id]
        except KeyError:
            raise DataError(f"{self.path}: no video {video_id!r}") from None

    def frame_counts(self) -> dict[str, int]:
        """Frames per video, for every video."""
        return dict(self._counts)

    def frames(self, video_id: str) -> np.ndarray:
        """Frames of ``video_id``, (n, D) float32."""
        if video_id not in self._counts:
            raise DataError(f"{self.path}: no video {video_id!r}")
        return self._arrays.read(video_id)  # (n, D)

    def close(self) -> None:
        """Close this process's HDF5 handle."""
        self._arrays.close()

    def __repr__(self) -> str:
        return f"HDF5Features({str(self.path)!r}, videos={len(self)}, dim={self._dim})"


def open_visual_features(path: str | Path) -> VisualFeatures:
    """Open visual features: a BigFile folder, or an HDF5 file (one dataset per video)."""
    path = Path(path)
    if path.is_dir():
        return BigFile(path)
    if path.is_file():
        return HDF5Features(path)
    raise DataError(f"visual features not found: {path} (expected a BigFile folder or an HDF5 file)")
