"""open_collection / SplitIndex on hand-written collections."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest

from prvrlab.data.collection import configured_splits, open_collection
from prvrlab.data.errors import DataError


@pytest.mark.parametrize("fmt", ["bigfile", "hdf5"])
def test_split_index_groups_queries_per_video(tmp_path, files, fmt):
    cfg = files.make_collection(tmp_path / fmt, files.toy_videos, files.toy_captions, fmt=fmt)
    col = open_collection(cfg)
    assert (col.video_dim, col.query_dim) == (6, 4)
    assert col.visual.format == fmt
    train = col.split("train")
    assert train.video_ids == ["vA", "vB", "vC"]  # first appearance in the caption file
    assert train.query_ids == ["vA#0", "vA#1", "vB#0", "vB#1", "vC#0"]  # grouped, file order kept within
    assert train.query_texts[1] == "caption number 2"
    assert train.query_video.dtype == np.int64 and train.query_video.tolist() == [0, 0, 1, 1, 2]
    assert train.query_offsets.tolist() == [0, 2, 4, 5]
    assert train.queries_of(1) == slice(2, 4)
    assert train.frame_counts.tolist() == [5, 40, 3]
    assert train.token_counts.tolist() == [3, 35, 2, 4, 1]
    assert train.ratios is None
    assert col.split("train") is train  # cached
    val = col.split("val")
    assert val.video_ids == ["vD"] and val.frame_counts.tolist() == [140]
    np.testing.assert_array_equal(col.visual.frames("vB"), files.video_frames(40, 6, 2))


def test_ratios_from_timestamps(tmp_path, files):
    stamps = {"train": {"vA#0": [0.0, 1.0, 10.0], "vB#1": [2.0, 8.0, 10.0], "vC#0": [0, 5, 5]}}
    cfg = files.make_collection(tmp_path / "ts", files.toy_videos, files.toy_captions, timestamps=stamps)
    r = open_collection(cfg).split("train").ratios
    np.testing.assert_allclose(r[[0, 3, 4]], [0.1, 0.6, 1.0])
    assert np.isnan(r[1]) and np.isnan(r[2])  # vA#1, vB#0 have no timestamps


def test_absolute_and_custom_paths(tmp_path, files, toy_cfg):
    abs_visual = str(tmp_path / "toy" / "FeatureData" / "feat")
    query = tmp_path / "toy" / "TextData" / "roberta_toy_query_feat.hdf5"
    query.rename(tmp_path / "q.hdf5")
    cfg = dataclasses.replace(toy_cfg, visual_feature=abs_visual, text_feature=str(tmp_path / "q.hdf5"))
    assert open_collection(cfg).split("val").num_queries == 2


def test_configured_splits_and_pickle(toy_cfg):
    assert configured_splits(toy_cfg) == ["train", "val"]
    assert configured_splits(dataclasses.replace(toy_cfg, test_split="val")) == ["train", "val"]
    col = open_collection(toy_cfg)
    col.visual.frames("vA")
    clone = pickle.loads(pickle.dumps(col))
    np.testing.assert_array_equal(clone.visual.frames("vA"), col.visual.frames("vA"))
    assert clone.split("train").query_ids == col.split("train").query_ids


def test_release_layout_parent_root_and_only_feature_store(tmp_path, files):
    cfg = files.make_collection(tmp_path / "tvr", files.toy_videos, files.toy_captions, name="tvr")
    cfg = dataclasses.replace(cfg, root=str(tmp_path), visual_feature=None)
    collection = open_collection(cfg)
    assert collection.root == tmp_path / "tvr"
    assert collection.visual.path == tmp_path / "tvr" / "FeatureData" / "feat"
    assert collection.notes == [f"data.visual_feature not given: using the only feature store {collection.visual.path}"]


def test_several_feature_stores_are_listed(tmp_path, files):
    cfg = files.make_collection(tmp_path / "c", files.toy_videos, files.toy_captions)
    files.write_h5(tmp_path / "c" / "FeatureData" / "clip.hdf5", {"vA": np.zeros((2, 6), np.float32)})
    with pytest.raises(DataError, match=r"several visual feature stores in .*FeatureData: clip\.hdf5, feat; set data"):
        open_collection(dataclasses.replace(cfg, visual_feature=None))
