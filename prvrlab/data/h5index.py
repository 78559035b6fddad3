"""What an HDF5 file's root datasets are: names, shapes, float32-run offsets, saved per file version.

:class:`~prvrlab.data.features.H5Arrays` lists a file's root datasets and
measures each one's shape and, for a contiguous little-endian float32
dataset, where its bytes lie.  Through HDF5 that costs ~0.02 ms a name and
~0.14 ms a dataset: ~17 s for TVR's 109k query datasets, in every process
that opens the collection.  An :class:`H5Index` holds those tables, filled
in as datasets are measured, and is saved with :mod:`prvrlab.data.index_cache`
(kind ``h5``) for the next process that opens the same version of the file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from prvrlab.data import index_cache

UNKNOWN = -1  # a shape row not measured yet; the offset of a dataset that is not a float32 run (or not measured)
KIND = "h5"


class H5Index:
    """One version of a file's root dataset names (file order), with shapes and float32-run offsets
    filled in as they are measured (:data:`UNKNOWN` until then)."""

    def __init__(
        self,
        *,
        keys: list[str],
        stamp: tuple[int, ...],
        shapes: np.ndarray | None = None,
        offsets: np.ndarray | None = None,
    ) -> None:
        n = len(keys)
        self.keys = keys
        self.stamp = tuple(int(s) for s in stamp)
        self.position = {key: i for i, key in enumerate(keys)}
        self.shapes = np.full((n, 2), UNKNOWN, dtype=np.int64) if shapes is None else shapes  # (n, 2)
        self.offsets = np.full(n, UNKNOWN, dtype=np.int64) if offsets is None else offsets  # (n,)

    def unknown(self, positions: np.ndarray) -> np.ndarray:
        """The ``positions`` whose shape has not been measured, in the given order."""
        return positions[self.shapes[positions, 0] == UNKNOWN]

    @classmethod
    def load(cls, path: Path, stamp: tuple[int, ...]) -> H5Index | None:
        """The saved index of ``path`` when it describes version ``stamp``; None otherwise."""
        found = index_cache.load(KIND, path, stamp, ("shapes", "offsets"))
        if found is None:
            return None
        keys, saved = found
        shapes, offsets = saved["shapes"], saved["offsets"]
        n = len(keys)
        if shapes.shape != (n, 2) or offsets.shape != (n,) or shapes.dtype.kind != "i" or offsets.dtype.kind != "i":
            return None  # not written by save
        if (shapes < UNKNOWN).any() or (offsets < UNKNOWN).any():
            return None
        return cls(keys=keys, stamp=stamp, shapes=shapes.astype(np.int64), offsets=offsets.astype(np.int64))

    def save(self, path: Path) -> None:
        """Save this index for ``path`` (:func:`prvrlab.data.index_cache.save`)."""
        index_cache.save(KIND, path, self.stamp, self.keys, {"shapes": self.shapes, "offsets": self.offsets})
