"""Zero-frame videos and NaN/inf features: named by inspect, refused before training."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

from prvrlab.data.errors import DataError
from prvrlab.data.features import open_visual_features
from prvrlab.data.inspect import inspect_collection
from prvrlab.data.integrity import check_visual_features


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PRVRLAB_CACHE_DIR", str(tmp_path / "cache"))


def _poison(cfg, row: int, value: float = np.nan) -> None:
    path = os.path.join(cfg.root, "FeatureData", "feat", "feature.bin")
    mm = np.memmap(path, dtype="<f4", mode="r+", shape=(os.path.getsize(path) // 24, 6))
    mm[row, 2] = value
    mm.flush()
    del mm


def test_nan_in_feature_bin_named_by_inspect(toy_cfg):
    _poison(toy_cfg, 7)  # vB starts at row 5
    with pytest.raises(DataError, match=r"feature\.bin: non-finite value .* row 7, a frame of video 'vB'"):
        inspect_collection(toy_cfg)


def test_inf_in_hdf5_named(tmp_path, files):
    cfg = files.make_collection(tmp_path / "h", files.toy_videos, files.toy_captions, fmt="hdf5")
    path = tmp_path / "h" / "FeatureData" / "feat.hdf5"
    arrays = {v: files.video_frames(n, 6, i + 1) for i, (v, n) in enumerate(files.toy_videos.items())}
    arrays["vC"][1, 0] = np.inf
    files.write_h5(path, arrays)
    with pytest.raises(DataError, match=r"feat\.hdf5: non-finite value .* video 'vC', row 1"):
        inspect_collection(cfg)


def test_zero_frame_video_outside_splits_is_named(tmp_path, files):
    cfg = files.make_collection(tmp_path / "z", {**files.toy_videos, "vEmpty": 0}, files.toy_captions)
    with pytest.raises(DataError, match=r"video2frames\.txt: video 'vEmpty' has no frame"):
        inspect_collection(cfg)


def test_clean_result_is_cached_by_size_and_mtime(toy_cfg, monkeypatch):
    visual = open_visual_features(os.path.join(toy_cfg.root, "FeatureData", "feat"))
    check_visual_features(visual, progress=False)
    calls = []
    monkeypatch.setattr("prvrlab.data.integrity._scan_bigfile", lambda *a: calls.append(a))
    check_visual_features(visual, progress=False)
    assert calls == []
    monkeypatch.undo()
    monkeypatch.setenv("PRVRLAB_CACHE_DIR", str(toy_cfg.root) + "/../cache")
    _poison(toy_cfg, 0)
    stat = os.stat(visual.path / "feature.bin")
    os.utime(visual.path / "feature.bin", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    with pytest.raises(DataError, match="row 0, a frame of video 'vA'"):
        check_visual_features(visual, progress=False)


def test_a_store_changed_during_its_scan_is_scanned_again(toy_cfg, monkeypatch):
    """The clean result is remembered with the version taken before the scan: a write that lands while
    the scan runs (the scan may have read the old bytes) leaves the store to be checked again."""
    from prvrlab.data import index_cache, integrity

    visual = open_visual_features(os.path.join(toy_cfg.root, "FeatureData", "feat"))
    path = visual.path / "feature.bin"
    scan = integrity._scan_bigfile

    def scan_then_touch(*args):
        scan(*args)
        stat = os.stat(path)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))

    monkeypatch.setattr(integrity, "_scan_bigfile", scan_then_touch)
    check_visual_features(visual, progress=False)
    assert index_cache.index_file(integrity.FINITE, path).exists()  # remembered, for the version it scanned
    calls = []
    monkeypatch.setattr(integrity, "_scan_bigfile", lambda *a: calls.append(a))
    check_visual_features(visual, progress=False)
    assert len(calls) == 1, "a store written during its scan was taken as checked"
    check_visual_features(visual, progress=False)
    assert len(calls) == 1  # that second scan saw no change: remembered


def test_scan_progress_counts_rows_up_to_100_percent(toy_cfg, monkeypatch, capsys):
    visual = open_visual_features(os.path.join(toy_cfg.root, "FeatureData", "feat"))
    rows = visual.num_rows
    step = rows // 2 + 1  # two chunks, the second one short
    monkeypatch.setattr("prvrlab.data.integrity.CHUNK_BYTES", step * 6 * 4)  # rows of 6 float32
    check_visual_features(visual, progress=True, use_cache=False)
    shown = [int(p) for p in re.findall(r"NaN/inf: (\d+)%", capsys.readouterr().err)]
    assert shown == [100 * step // rows, 100]
