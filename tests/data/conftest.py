"""Hand-written data files (independent of the synthetic generator) and shared fixtures."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import h5py
import numpy as np
import pytest
import torch

from prvrlab.data.config import DataConfig


def write_bigfile(folder: Path, frame_ids: list[str], matrix: np.ndarray, video2frames: dict[str, list[str]]) -> Path:
    """Write a BigFile folder by hand: rows of ``matrix`` are the frames ``frame_ids``."""
    folder.mkdir(parents=True, exist_ok=True)
    matrix = np.asarray(matrix, dtype="<f4")
    (folder / "feature.bin").write_bytes(matrix.tobytes())
    (folder / "shape.txt").write_text(f"{matrix.shape[0]} {matrix.shape[1]}\n")
    (folder / "id.txt").write_bytes(" ".join(frame_ids).encode("latin-1"))
    (folder / "video2frames.txt").write_bytes(repr(video2frames).encode("latin-1"))
    return folder


@pytest.fixture(autouse=True)
def _on_the_cpu():
    """The data layer makes CPU tensors only (the loop moves batches): its tests build their expectations on the CPU
    whatever PRVRLAB_TEST_DEVICE names."""
    with torch.device("cpu"):
        yield


def write_h5(path: Path, arrays: dict[str, np.ndarray]) -> Path:
    """One dataset per key at the root of an HDF5 file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(path, "w") as f:
        for key, value in arrays.items():
            f.create_dataset(key, data=value)
    return path


def video_frames(n: int, dim: int, seed: int) -> np.ndarray:
    """Deterministic, distinct frame values (row i of video seed: seed*1000 + i + column / 10)."""
    return (seed * 1000 + np.arange(n)[:, None] + np.arange(dim)[None, :] / 10).astype(np.float32)


def make_collection(
    root: Path,
    videos: dict[str, int],
    captions: dict[str, list[tuple[str, int]]],
    *,
    video_dim: int = 6,
    query_dim: int = 4,
    fmt: str = "bigfile",
    name: str = "toy",
    timestamps: dict[str, dict[str, list[float]]] | None = None,
) -> DataConfig:
    """Write a small collection by hand and return the DataConfig that points to it.

    ``videos``: video id -> frame count (frames from :func:`video_frames`);
    ``captions``: split -> [(cap_id, n_tokens)], token j of query q is
    ``(q_index * 100 + j + 1) * ones`` per split, in caption order.
    """
    feat_dir = root / "FeatureData"
    text_dir = root / "TextData"
    text_dir.mkdir(parents=True, exist_ok=True)
    arrays = {vid: video_frames(n, video_dim, i + 1) for i, (vid, n) in enumerate(videos.items())}
    if fmt == "bigfile":
        ids, rows, v2f = [], [], {}
        for vid, x in arrays.items():
            fids = [f"{vid}/{t}" for t in range(len(x))]
            ids += fids
            rows.append(x)
            v2f[vid] = fids
        write_bigfile(feat_dir / "feat", ids, np.concatenate(rows), v2f)
        visual = "feat"
    else:
        write_h5(feat_dir / "feat.hdf5", arrays)
        visual = "feat.hdf5"
    queries = {}
    for split, caps in captions.items():
        lines = []
        for q, (cap_id, n_tokens) in enumerate(caps):
            queries[cap_id] = np.repeat((q * 100 + np.arange(n_tokens) + 1.0)[:, None], query_dim, axis=1).astype(np.float32)
            lines.append(f"{cap_id} caption number {q}\n")
        (text_dir / f"{name}{split}.caption.txt").write_text("".join(lines))
    write_h5(text_dir / f"roberta_{name}_query_feat.hdf5", queries)
    for split, stamps in (timestamps or {}).items():
        (text_dir / f"{name}{split}.timestamps.json").write_text(json.dumps(stamps))
    return DataConfig(
        root=str(root), collection=name, visual_feature=visual, train_split="train", val_split="val", test_split=None
    )


TOY_VIDEOS = {"vA": 5, "vB": 40, "vC": 3, "vD": 140}
TOY_CAPTIONS = {
    "train": [("vA#0", 3), ("vB#0", 2), ("vA#1", 35), ("vC#0", 1), ("vB#1", 4)],
    "val": [("vD#0", 2), ("vD#1", 5)],
}


@pytest.fixture
def files() -> SimpleNamespace:
    """The hand-written file helpers of this conftest (usable whatever pytest's import mode)."""
    return SimpleNamespace(
        write_bigfile=write_bigfile,
        write_h5=write_h5,
        video_frames=video_frames,
        make_collection=make_collection,
        toy_videos=TOY_VIDEOS,
        toy_captions=TOY_CAPTIONS,
    )


@pytest.fixture
def toy_cfg(tmp_path: Path) -> DataConfig:
    """A hand-written BigFile collection: 3 train videos (5, 40, 3 frames), 1 val video (140 frames)."""
    return make_collection(tmp_path / "toy", TOY_VIDEOS, TOY_CAPTIONS)


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> Path:
    """The tiny synthetic preset, written once per test session."""
    from prvrlab.data.synth import synthesize

    return synthesize(tmp_path_factory.mktemp("synth") / "tiny", preset="tiny", seed=0, progress=False)
