"""Convert a BigFile folder to an HDF5 file with one dataset per video."""

from __future__ import annotations

import os
from pathlib import Path

import h5py
from tqdm import tqdm

from prvrlab.data.bigfile import BigFile
from prvrlab.data.errors import DataError


def destination_problem(src_folder: str | Path, dst_h5: str | Path) -> str | None:
    """Why ``dst_h5`` cannot be written from ``src_folder``: it is that folder or lies inside it
    (symlinks resolved), where it would replace or sit among the source's files; None when it can."""
    if "://" in str(dst_h5):
        return None  # a URI is not a local file in the source folder
    source = Path(src_folder).expanduser().resolve()
    target = Path(dst_h5).expanduser().resolve()
    if target == source:
        return f"is the source folder {src_folder}; give an HDF5 file name outside it"
    if source in target.parents:
        return f"lies inside the source folder {src_folder} (it would overwrite or add to the source's files); give an HDF5 file name outside it"
    return None


def convert_bigfile(src_folder: str | Path, dst_h5: str | Path, *, progress: bool = True) -> Path:
    """Write every video of the BigFile ``src_folder`` to ``dst_h5`` as a (n_frames, D) float32 dataset.

    Streams video by video (memory holds one video at a time) into a
    temporary file that replaces ``dst_h5`` only when complete.  Raises
    DataError naming the file for a destination inside ``src_folder``, a bad BigFile, a video id that cannot be an
    HDF5 dataset name, or a write failure.  Returns ``dst_h5``.
    """
    problem = destination_problem(src_folder, dst_h5)
    if problem:
        raise DataError(f"{dst_h5}: {problem}")
    src = BigFile(src_folder)
    dst = Path(dst_h5)
    bad = [v for v in src.video_ids() if "/" in v or "\0" in v or v in ("", ".")]  # HDF5 cuts a name at a NUL
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
