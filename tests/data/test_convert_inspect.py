"""BigFile -> HDF5 conversion and the inspect report."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from prvrlab.data.bigfile import BigFile
from prvrlab.data.collection import open_collection
from prvrlab.data.convert import convert_bigfile
from prvrlab.data.errors import DataError
from prvrlab.data.features import HDF5Features
from prvrlab.data.inspect import inspect_collection
from prvrlab.data.config import DataConfig


def test_convert_round_trip(toy_cfg, tmp_path, files):
    src = tmp_path / "toy" / "FeatureData" / "feat"
    dst = convert_bigfile(src, tmp_path / "toy" / "FeatureData" / "feat.hdf5", progress=False)
    bf, h5 = BigFile(src), HDF5Features(dst)
    assert h5.video_ids() == bf.video_ids() and h5.dim == bf.dim
    for vid in bf.video_ids():
        got = h5.frames(vid)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, bf.frames(vid))
    np.testing.assert_array_equal(h5.frames("vD"), files.video_frames(140, 6, 4))
    # the converted file serves the same collection
    cfg = dataclasses.replace(toy_cfg, visual_feature="feat.hdf5")
    assert open_collection(cfg).split("train").frame_counts.tolist() == [5, 40, 3]
    assert not [p for p in dst.parent.iterdir() if p.name.startswith(".")]


def test_convert_errors(tmp_path, files):
    with pytest.raises(DataError, match="BigFile folder not found: .*nope"):
        convert_bigfile(tmp_path / "nope", tmp_path / "x.h5", progress=False)
    files.write_bigfile(tmp_path / "slash", ["a0", "a1"], np.zeros((2, 3)), {"dir/vid": ["a0", "a1"]})
    with pytest.raises(DataError, match="video2frames.txt: video id 'dir/vid' cannot be an HDF5 dataset name"):
        convert_bigfile(tmp_path / "slash", tmp_path / "x.h5", progress=False)


def test_inspect_report(toy_cfg):
    report = inspect_collection(toy_cfg)
    assert [s.name for s in report.splits] == ["train", "val"]
    train, val = report.splits
    assert (train.videos, train.queries) == (3, 5)
    assert train.queries_per_video == (1, 5 / 3, 2)
    assert train.frames == (3, 16.0, 40)
    assert train.tokens == (1, 9.0, 35) and train.queries_truncated == 1
    assert val.videos_pooled == 1 and train.videos_pooled == 0
    assert train.ratio_groups is None
    # float32 rows held by data.resident: frames (none pooled in train; val's 140 pooled to 128), 32 clips a video
    # (6-d), tokens (35 cut to 30; 4-d)
    assert train.resident_bytes == 4 * ((5 + 40 + 3 + 3 * 32) * 6 + (3 + 2 + 30 + 1 + 4) * 4)
    assert val.resident_bytes == 4 * ((128 + 32) * 6 + (2 + 5) * 4)
    assert (report.video_dim, report.query_dim, report.feature_videos, report.query_features) == (6, 4, 4, 7)
    text = report.format()
    for needle in ("collection 'toy'", "bigfile", "train", "val", "3/16.0/40", "1/1.7/2", ">128 fr", ">30 tok", "resident GiB"):
        assert needle in text
    assert not report.warnings


def test_inspect_warns_on_shared_videos(toy_cfg):
    report = inspect_collection(toy_cfg, splits=["train", "train"])
    assert report.warnings and "also appear in split 'train'" in report.warnings[0]


def test_inspect_never_synthesizes(tmp_path):
    with pytest.raises(DataError, match="data root not found"):
        inspect_collection(DataConfig(root=str(tmp_path / "none"), synthesize="tiny"))


def test_convert_refuses_a_destination_inside_the_source(tiny_root, tmp_path):
    import re
    import shutil

    src = tmp_path / "synth_feat"
    shutil.copytree(tiny_root / "FeatureData" / "synth_feat", src)
    before = (src / "feature.bin").read_bytes()
    with pytest.raises(DataError, match="^" + re.escape(f"{src / 'feature.bin'}: lies inside the source folder {src} ")):
        convert_bigfile(src, src / "feature.bin", progress=False)
    assert (src / "feature.bin").read_bytes() == before
    assert sorted(p.name for p in src.iterdir()) == ["feature.bin", "id.txt", "shape.txt", "video2frames.txt"]
