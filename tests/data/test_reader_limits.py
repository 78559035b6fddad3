"""Hostile input files: deep nesting, huge or negative ids, implausible HDF5 datasets, NaN query tokens."""

from __future__ import annotations

import json
import os
import sys

import h5py
import numpy as np
import pytest

from prvrlab.data import features
from prvrlab.data.bigfile import read_video2frames
from prvrlab.data.collection import open_collection
from prvrlab.data.dataset import VideoDataset
from prvrlab.data.errors import DataError
from prvrlab.data.features import MAX_ELEMENTS, HDF5Features
from prvrlab.data.inspect import inspect_collection
from prvrlab.data.text import QueryFeatures, read_timestamps
from prvrlab.data.truth import MAX_TABLE_CELLS, RelevanceTruth

DEPTH = 4 * sys.getrecursionlimit()  # deeper than any recursive decoder goes


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PRVRLAB_CACHE_DIR", str(tmp_path / "cache"))


def test_deeply_nested_video2frames_names_the_file(tmp_path):
    path = tmp_path / "video2frames.txt"
    path.write_text("{'a': " + "[" * DEPTH + "]" * DEPTH + "}")
    with pytest.raises(DataError, match=r"video2frames\.txt: not a Python dict literal \(RecursionError"):
        read_video2frames(path)


def test_deeply_nested_timestamps_name_the_file(tmp_path):
    path = tmp_path / "ctrain.timestamps.json"
    path.write_text('{"a#0": ' + "[" * DEPTH + "]" * DEPTH + "}")
    with pytest.raises(DataError, match=r"ctrain\.timestamps\.json: not valid JSON"):
        read_timestamps(path)


TRUTH = {"queries": {"q0": [0, 1], "q1": [None, 1]}, "videos": {"v0": [[0, 1]], "v1": [[1, 0]]}}


def _truth_file(tmp_path, raw) -> str:
    path = tmp_path / "ctrain.truth.json"
    path.write_text(raw if isinstance(raw, str) else json.dumps(raw))
    return str(path)


def test_a_valid_truth_file_loads_as_built_by_hand(tmp_path):
    loaded = RelevanceTruth.load(_truth_file(tmp_path, TRUTH))
    by_hand = RelevanceTruth(**TRUTH)
    assert loaded.relevant(["q0", "q1"], ["v0", "v1"]).tolist() == by_hand.relevant(["q0", "q1"], ["v0", "v1"]).tolist()


@pytest.mark.parametrize(
    "raw, message",
    [
        ('{"queries": ' + "[" * DEPTH + "]" * DEPTH + ', "videos": {}}', "not a ground-truth file"),
        ({**TRUTH, "videos": {"v0": [[-3, 0]]}}, "video 'v0'"),
        ({**TRUTH, "videos": {"v0": [[True, 0]]}}, "video 'v0'"),
        ({**TRUTH, "videos": {"v0": 3}}, "video 'v0'"),
        ({**TRUTH, "videos": {"v0": [[10**12, 0]]}}, f"at most {MAX_TABLE_CELLS}"),
        ({**TRUTH, "queries": {"q0": [-1, 0]}}, "query 'q0'"),
        ({**TRUTH, "queries": {"q0": [0, 2]}}, "query 'q0'"),  # no video shows object 2: out of the table
        ({**TRUTH, "queries": {"q0": [None, None]}}, "query 'q0'"),
        ({"queries": [], "videos": {}}, "not a ground-truth file"),
    ],
)
def test_malformed_truth_files_are_named(tmp_path, raw, message):
    path = _truth_file(tmp_path, raw)
    with pytest.raises(DataError, match=rf"ctrain\.truth\.json: .*{message}"):
        RelevanceTruth.load(path)


def _h5(path, make) -> str:
    with h5py.File(path, "w") as f:
        f.create_dataset("a", data=np.ones((3, 4), np.float32))  # the first key: what QueryFeatures measures on open
        make(f)
    return str(path)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda f: f.create_dataset("bad", shape=(MAX_ELEMENTS, 4), dtype="f4", chunks=(1, 4)), "more than"),
        (lambda f: f.create_dataset("bad", shape=(1 << 22, 4), dtype="f4", chunks=(64, 4)), "more than the file holds"),
        (lambda f: f.create_dataset("bad", data=np.array([[b"x"] * 4] * 3)), "expected numbers"),
        (lambda f: f.create_dataset("bad", data=np.zeros((3, 4), [("x", "f4"), ("y", "f4")])), "expected numbers"),
        (lambda f: f.create_dataset("bad", data=np.zeros((3, 0), np.float32)), "invalid shape N=3 D=0"),
    ],
)
def test_implausible_hdf5_datasets_are_refused_naming_file_and_key(tmp_path, make, message):
    visual = _h5(tmp_path / "v.hdf5", make)
    with pytest.raises(DataError, match=rf"v\.hdf5: dataset 'bad'.*{message}"):
        HDF5Features(visual)
    queries = QueryFeatures(_h5(tmp_path / "q.hdf5", make))
    with pytest.raises(DataError, match=rf"q\.hdf5: dataset 'bad'.*{message}"):
        queries.check(["a", "bad"])
    with pytest.raises(DataError, match=rf"q\.hdf5: dataset 'bad'.*{message}"):
        queries.tokens("bad")


def test_a_compressed_dataset_larger_than_the_file_is_read(tmp_path):
    values = np.zeros((1 << 16, 4), np.float32)
    values[-1] = 2.0
    path = tmp_path / "v.hdf5"
    with h5py.File(path, "w") as f:
        f.create_dataset("z", data=values, compression="gzip")
    assert values.nbytes > os.path.getsize(path)
    np.testing.assert_array_equal(HDF5Features(path).frames("z"), values)


def test_query_tokens_read_only_the_first_rows(tmp_path, monkeypatch):
    values = np.arange(40 * 3, dtype=np.float32).reshape(40, 3)
    path = tmp_path / "q.hdf5"
    with h5py.File(path, "w") as f:
        f.create_dataset("run", data=values)
        f.create_dataset("gz", data=values, compression="gzip")
    queries = QueryFeatures(path)
    queries.check(["run", "gz"])
    shapes = []
    real = features.read_float32
    monkeypatch.setattr(features, "read_float32",
                        lambda fd, offset, shape, **kw: shapes.append(shape) or real(fd, offset, shape, **kw))
    for key in ("run", "gz"):
        np.testing.assert_array_equal(queries.tokens(key, max_len=7), values[:7])
        np.testing.assert_array_equal(queries.tokens(key, max_len=100), values)
    assert shapes == [(7, 3), (40, 3)]  # the positioned read asks for the first rows only


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_non_finite_query_tokens_are_named_by_reader_dataset_and_inspect(tmp_path, files, value):
    cfg = files.make_collection(tmp_path / "c", files.toy_videos, files.toy_captions)
    path = tmp_path / "c" / "TextData" / "roberta_toy_query_feat.hdf5"
    with h5py.File(path, "r+") as f:
        tokens = f["vB#1"][()]
        tokens[2, 1] = value
        del f["vB#1"]
        f.create_dataset("vB#1", data=tokens)
    message = r"roberta_toy_query_feat\.hdf5: non-finite value \(NaN/inf\) in query 'vB#1', token 2"
    collection = open_collection(cfg)
    with pytest.raises(DataError, match=message):
        collection.queries.tokens("vB#1")
    dataset = VideoDataset(collection, "train")
    with pytest.raises(DataError, match=message):
        [dataset[i] for i in range(len(dataset))]
    with pytest.raises(DataError, match=message):
        inspect_collection(cfg)


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_a_caption_file_that_is_not_a_file_is_named(tmp_path, files, kind):
    cfg = files.make_collection(tmp_path / "c", files.toy_videos, files.toy_captions)
    path = tmp_path / "c" / "TextData" / "toytrain.caption.txt"
    path.unlink()
    os.mkfifo(path) if kind == "fifo" else path.mkdir()
    what = "a FIFO" if kind == "fifo" else "a folder"
    with pytest.raises(DataError, match=rf"toytrain\.caption\.txt: is {what}") as err:
        open_collection(cfg).split("train")
    assert "did you mean" not in str(err.value)
