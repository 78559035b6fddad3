"""A damaged HDF5 file (overwritten B-tree or object headers: h5py raises RuntimeError, not OSError) is one
DataError naming the file, for the query features and for a converted visual store, not a traceback."""

from __future__ import annotations

import shutil

import pytest

from prvrlab.data.convert import convert_bigfile
from prvrlab.data.errors import DataError
from prvrlab.data.features import H5Arrays


def _damage(path, start: int, end: int) -> None:
    with open(path, "r+b") as f:
        f.seek(start)
        f.write(b"\x5a" * (end - start))


def _read_all(path) -> None:
    arrays = H5Arrays(path)
    keys = arrays.keys()
    arrays.shapes(keys)
    for key in keys:
        arrays.read(key)


def test_a_query_file_with_a_damaged_b_tree_is_one_error_naming_it(tiny_root, tmp_path):
    path = tmp_path / "queries.hdf5"
    shutil.copy(tiny_root / "TextData" / "roberta_synth_query_feat.hdf5", path)
    _read_all(path)  # whole before
    _damage(path, 150_000, 350_000)
    with pytest.raises(DataError, match=rf"^{path}: "):
        _read_all(path)


def test_a_converted_store_with_damaged_headers_is_one_error_naming_it(tiny_root, tmp_path):
    path = convert_bigfile(tiny_root / "FeatureData" / "synth_feat", tmp_path / "visual.hdf5", progress=False)
    _read_all(path)
    _damage(path, 136, 800)
    with pytest.raises(DataError, match=rf"^{path}: "):
        _read_all(path)
