"""Feature stores that would give wrong or unexplained results: one DataError naming the file and the id."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest

from prvrlab.data.bigfile import BigFile, read_video2frames
from prvrlab.data.convert import convert_bigfile
from prvrlab.data.errors import DataError
from prvrlab.data.features import HDF5Features
from prvrlab.data.synth import refresh_if_outdated



@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PRVRLAB_CACHE_DIR", str(tmp_path / "cache"))


def test_a_frame_id_naming_two_rows_is_refused_not_read_from_the_last(tmp_path, files):
    """The official reader's name -> row dict keeps the last row: video v read frame f0 from row 2."""
    m = np.arange(6, dtype=np.float32).reshape(3, 2)
    folder = files.write_bigfile(tmp_path / "a", ["f0", "f1", "f0"], m, {"v": ["f0", "f1"]})
    with pytest.raises(DataError, match=r"id\.txt: frame id 'f0' names 2 rows of feature\.bin \(1 repeated ids in total\)"):
        BigFile(folder)
    assert BigFile(files.write_bigfile(tmp_path / "b", ["f0", "f1", "f2"], m, {"v": ["f0", "f1"]})).frames("v").tolist() == [[0, 1], [2, 3]]


@pytest.mark.parametrize("text", ["{'v': ['f0'], 'w': ['f1'], 'v': ['f2']}", '{"v": ["f0"], "w": ["f1"], "v": ["f2"]}',
                                  "{'v': ['f0'], 'w': ['f1'],\n 'v': ['f2'], 'x\\\\y': []}"])
def test_a_video_listed_twice_in_video2frames_is_refused(tmp_path, text):
    """Both parsers (the JSON fast path and literal_eval) kept only the last entry of a repeated video."""
    path = tmp_path / "video2frames.txt"
    path.write_text(text)
    with pytest.raises(DataError, match=rf"{path}: video 'v' is listed 2 times; each video must be listed once"):
        read_video2frames(path)


@pytest.mark.parametrize("text, expected", [("{}", {}), ("{'a': ['x'], 'b': []}", {"a": ["x"], "b": []}),
                                            ("{'a\\\\b': ['x']}", {"a\\b": ["x"]})])
def test_video2frames_without_repeats_reads_as_before(tmp_path, text, expected):
    path = tmp_path / "video2frames.txt"
    path.write_text(text)
    assert read_video2frames(path) == expected


@pytest.mark.parametrize("text, message", [("[]", "expected a dict .*got list"),
                                           ("{'a': {'b': 1}}", r"entry 'a': expected a str video id -> list of str frame ids, got \{'b': 1\}")])
def test_video2frames_that_is_no_dict_of_lists_is_refused_as_before(tmp_path, text, message):
    path = tmp_path / "video2frames.txt"
    path.write_text(text)
    with pytest.raises(DataError, match=message):
        read_video2frames(path)


def test_an_hdf5_dataset_with_an_empty_dataspace_is_refused_by_name(tmp_path):
    path = tmp_path / "null.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("v", data=np.ones((3, 4), dtype="f4"))
        f.create_dataset("z", data=h5py.Empty("f4"))
    with pytest.raises(DataError, match=rf"{path}: dataset 'z' has no shape \(an empty dataspace\), expected \(n, D\)"):
        HDF5Features(path).frames("z")


def test_a_corrupt_compressed_chunk_names_the_file_and_the_dataset(tmp_path):
    path = tmp_path / "gz.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("v", data=np.random.default_rng(0).random((64, 64), dtype=np.float32), compression="gzip", chunks=(64, 64))
        offset = f["v"].id.get_chunk_info(0).byte_offset
    data = bytearray(path.read_bytes())
    for i in range(offset + 20, offset + 200):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))
    with pytest.raises(DataError, match=rf"{path}: cannot read dataset 'v' \(.*\)"):
        HDF5Features(path).frames("v")


@pytest.mark.parametrize("record", ["[]", '{"generator_version": "one"}', '{"generator_version": null}', "null"])
def test_a_malformed_synth_record_is_left_to_the_root_check(tmp_path, record):
    """refresh_if_outdated ran first and raised AttributeError / ValueError / TypeError tracebacks."""
    (tmp_path / "synth.json").write_text(record)
    assert refresh_if_outdated(tmp_path) is False
    assert json.loads((tmp_path / "synth.json").read_text()) == json.loads(record)  # left as it is


def test_convert_refuses_a_video_id_with_a_nul(tmp_path, files):
    """HDF5 cuts a dataset name at a NUL: 'a\\0b' was stored as 'a', or collided with it in a traceback."""
    m = np.arange(4, dtype=np.float32).reshape(2, 2)
    folder = files.write_bigfile(tmp_path / "bf", ["f0", "f1"], m, {"a\0b": ["f0"], "a": ["f1"]})
    with pytest.raises(DataError, match=r"video id 'a\\x00b' cannot be an HDF5 dataset name \(1 such ids\)"):
        convert_bigfile(folder, tmp_path / "out.h5", progress=False)
    assert not (tmp_path / "out.h5").exists()


def test_an_index_cached_before_the_repeat_checks_is_not_read(tmp_path, files):
    """An index saved under the earlier kind (by a prvrlab without the checks) opened a folder with repeated ids
    silently: the kind changed with them, so such a folder is indexed, and refused, again."""
    from prvrlab.data import bigfile, index_cache

    m = np.arange(6, dtype=np.float32).reshape(3, 2)
    folder = files.write_bigfile(tmp_path / "a", ["f0", "f1", "f0"], m, {"v": ["f0", "f1"]})
    stamp = index_cache.version(*(folder / name for name in bigfile.FILES))
    old = {"offsets": np.array([0, 2]), "rows": np.array([2, 1]), "contiguous": np.array([False])}  # f0: the last row
    index_cache.save("bigfile", folder, stamp, ["v"], old)  # what the code before the checks cached
    with pytest.raises(DataError, match="names 2 rows"):
        BigFile(folder)
