"""Convert a BigFile folder to an HDF5 file with one dataset per video."""

from __future__ import annotations

import os
from pathlib import Path

import h5py
from tqdm import tqdm

from prvrlab.data.bigfile import BigFile
from prvrlab.data.errors import DataError


def convert_bigfile(src_folder: str | Path, dst_h5: str | Path, *, progress: bool = True) -> Path:
    """Write every video of the BigFile ``src_folder`` to ``dst_h5`` as a (n_frames, D) float32 dataset.

    Streams video by video (memory holds one video at a time) into a
    temporary file that replaces ``dst_h5`` only when complete.  Raises
    DataError naming the file for a bad BigFile, a video id that cannot be an
    HDF5 dataset name, or a write failure.  Returns ``dst_h5``.
    """
    src = BigFile(src_folder)
    dst = Path(dst_h5)
    bad = [v for v in src.video_ids() if "/" in v or v in ("", ".")]
    if bad:
        raise DataError(
            f"{src.path / 'video2frames.txt'}: video id {bad[0]!r} cannot be an HDF5 dataset name "
            f"({len(bad)} such ids)"
        )
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        with h5py.File(tmp, "w") as f:
            for vid in tqdm(src.video_ids(), desc=f"convert {src.path.name}", unit="video", disable=not progress):
                f.create_dataset(vid, data=src.frames(vid))  # (n, D) float32
        os.replace(tmp, dst)
    except OSError as exc:
        raise DataError(f"{dst}: cannot write the HDF5 file ({exc})") from None
    finally:
        tmp.unlink(missing_ok=True)
        src.close()
    return dst
