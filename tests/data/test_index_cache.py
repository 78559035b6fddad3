"""The saved index of an HDF5 file's datasets (prvrlab.data.h5index, prvrlab.data.index_cache): another
opening of the same version lists and measures nothing through HDF5 and gets what a fresh walk of the file gives."""

from __future__ import annotations

import os

import h5py
import numpy as np
import pytest

from prvrlab.data import index_cache
from prvrlab.data.errors import DataError
from prvrlab.data.features import H5Arrays
from prvrlab.data.h5index import H5Index
from prvrlab.data.index_cache import prune


def index_file(path):
    return index_cache.index_file("h5", path)


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("PRVRLAB_CACHE_DIR", str(folder))
    return folder


@pytest.fixture
def hdf5_calls(monkeypatch):
    """Counts of the file being listed (h5py.File) and of datasets opened to be measured (h5d.open)."""
    calls = {"listed": 0, "opened": []}
    real_file, real_open = h5py.File, h5py.h5d.open

    def listing(*args, **kwargs):
        calls["listed"] += 1
        return real_file(*args, **kwargs)

    def opening(fid, name, *args):
        calls["opened"].append(name.decode())
        return real_open(fid, name, *args)

    monkeypatch.setattr(h5py, "File", listing)
    monkeypatch.setattr(h5py.h5d, "open", opening)
    return calls


def write(path, datasets):
    with h5py.File(path, "w") as f:
        for name, value in datasets.items():
            f.create_dataset(name, **value) if isinstance(value, dict) else f.create_dataset(name, data=value)


def toy(seed=0):
    """Contiguous float32 runs of several lengths, a chunked one and a float64 one (read through HDF5)."""
    rng = np.random.default_rng(seed)
    out = {f"v{i}#enc#{j}": rng.standard_normal((2 + i + j, 4)).astype(np.float32) for i in range(3) for j in range(2)}
    out["chunked"] = {"data": rng.standard_normal((5, 4)).astype(np.float32), "chunks": (2, 4)}
    out["double"] = rng.standard_normal((3, 4))
    return out


def values(datasets):
    return {k: (v["data"] if isinstance(v, dict) else v).astype(np.float32) for k, v in datasets.items()}


def test_a_second_opening_lists_and_measures_nothing_and_agrees_with_a_fresh_walk(tmp_path, hdf5_calls):
    path = tmp_path / "q.hdf5"
    data = toy()
    write(path, data)
    first = H5Arrays(path)
    shapes = first.shapes()
    assert shapes.tolist() == [list(values(data)[k].shape) for k in first.keys()]
    assert sorted(hdf5_calls["opened"]) == sorted(data)  # every dataset measured once
    assert index_file(path).is_file()
    hdf5_calls["listed"], hdf5_calls["opened"] = 0, []

    second = H5Arrays(path)
    assert second.keys() == first.keys()
    np.testing.assert_array_equal(second.shapes(), shapes)
    assert second._runs == first._runs  # the same byte runs, so the same positioned reads
    assert set(second._runs) == {k for k in data if k.startswith("v")}
    assert hdf5_calls == {"listed": 0, "opened": []}
    for key, want in values(data).items():
        np.testing.assert_array_equal(second.read(key), want)
    first.close()
    second.close()


def test_only_shapes_not_measured_before_are_measured_and_the_index_grows(tmp_path, hdf5_calls):
    path = tmp_path / "q.hdf5"
    data = toy()
    write(path, data)
    some = ["v2#enc#1", "v0#enc#0"]
    np.testing.assert_array_equal(H5Arrays(path).shapes(some), [[5, 4], [2, 4]])
    assert hdf5_calls["opened"] == some
    hdf5_calls["opened"] = []
    arrays = H5Arrays(path)
    arrays.shapes()
    assert sorted(hdf5_calls["opened"]) == sorted(set(data) - set(some))
    hdf5_calls["opened"] = []
    H5Arrays(path).shapes()
    assert hdf5_calls["opened"] == []


def test_a_new_version_of_the_file_is_indexed_again(tmp_path):
    path = tmp_path / "q.hdf5"
    write(path, {"a": np.zeros((2, 3), np.float32)})
    H5Arrays(path).shapes()
    fresh = tmp_path / "new.hdf5"
    write(fresh, {"pad": np.ones((50, 3), np.float32), "a": np.full((4, 3), 7.0, np.float32), "b": np.ones((1, 3), np.float32)})
    os.replace(fresh, path)
    arrays = H5Arrays(path)
    assert arrays.keys() == ["a", "b", "pad"]
    np.testing.assert_array_equal(arrays.shapes(["a"]), [[4, 3]])
    np.testing.assert_array_equal(arrays.read("a"), np.full((4, 3), 7.0, np.float32))
    arrays.close()


def test_a_file_replaced_after_it_was_listed_is_measured_afresh_and_not_saved(tmp_path):
    path = tmp_path / "q.hdf5"
    write(path, {"a": np.zeros((2, 3), np.float32)})
    arrays = H5Arrays(path)  # listed: version 1
    saved_before = index_file(path).exists()
    fresh = tmp_path / "new.hdf5"
    write(fresh, {"a": np.ones((6, 3), np.float32)})
    os.replace(fresh, path)
    np.testing.assert_array_equal(arrays.shapes(), [[6, 3]])  # the file as it is now
    assert index_file(path).exists() == saved_before  # nothing saved under version 1 with version 2's shapes
    np.testing.assert_array_equal(H5Arrays(path).shapes(), [[6, 3]])


def test_errors_name_the_first_bad_key_in_order_and_are_not_remembered(tmp_path):
    path = tmp_path / "q.hdf5"
    write(path, {"ok": np.zeros((2, 3), np.float32), "cube": np.zeros((2, 3, 4), np.float32)})
    for _ in range(2):  # the second opening finds "ok" in the index, and "cube" still fails
        arrays = H5Arrays(path)
        with pytest.raises(DataError, match=r"q.hdf5: dataset 'cube' has shape \(2, 3, 4\)"):
            arrays.shapes(["ok", "cube", "nope"])
        with pytest.raises(DataError, match=r"q.hdf5: no dataset 'nope'"):
            arrays.shapes(["ok", "nope", "cube"])
        np.testing.assert_array_equal(arrays.shapes(["ok"]), [[2, 3]])
    saved = H5Index.load(path, _version(path))
    assert saved is not None and saved.shapes.tolist() == [[-1, -1], [2, 3]]  # "cube" never recorded
    written = os.stat(index_file(path)).st_ino
    with pytest.raises(DataError, match="'cube'"):
        H5Arrays(path).shapes(["cube"])
    assert os.stat(index_file(path)).st_ino == written  # nothing measured: nothing saved again


def _version(path):
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def test_a_version_is_the_files_inode_size_and_mtime_not_its_device():
    """The same file seen from two nodes of a network file system (another device number) is one
    version; another inode, size, mtime or ctime is another."""
    from types import SimpleNamespace

    st = os.stat(__file__)
    seen = {"st_dev": st.st_dev, "st_ino": st.st_ino, "st_size": st.st_size, "st_mtime_ns": st.st_mtime_ns,
            "st_ctime_ns": st.st_ctime_ns}
    assert index_cache.stamp(st) == index_cache.stamp(SimpleNamespace(**seen))
    other_node = SimpleNamespace(**{**seen, "st_dev": st.st_dev + 1})
    assert index_cache.stamp(other_node) == index_cache.stamp(st)
    for field in ("st_ino", "st_size", "st_mtime_ns", "st_ctime_ns"):
        changed = SimpleNamespace(**{**seen, field: seen[field] + 1})
        assert index_cache.stamp(changed) != index_cache.stamp(st), field


def test_an_unreadable_or_foreign_index_is_ignored_and_replaced(tmp_path, hdf5_calls):
    path = tmp_path / "q.hdf5"
    data = toy()
    write(path, data)
    H5Arrays(path).shapes()
    good = index_file(path).read_bytes()
    with np.load(index_file(path)) as saved:
        fields = dict(saved)
    bad_files = {
        "garbage": b"not an npz",
        "truncated": good[: len(good) // 2],
    }
    bad_fields = {
        "another format": {**fields, "format": np.int64(index_cache.FORMAT + 1)},
        "another version": {**fields, "stamp": fields["stamp"] + 1},
        "too few keys": {**fields, "count": fields["count"] + 1},
        "negative offset": {**fields, "offsets": np.full_like(fields["offsets"], -7)},
        "a pickle": {**fields, "shapes": np.array([{"a": 1}], dtype=object)},
    }
    for name, fields_ in bad_fields.items():
        with open(index_file(path), "wb") as fh:
            np.savez(fh, **fields_)
        bad_files[name] = index_file(path).read_bytes()
    for name, content in bad_files.items():
        index_file(path).write_bytes(content)
        hdf5_calls["listed"], hdf5_calls["opened"] = 0, []
        arrays = H5Arrays(path)
        np.testing.assert_array_equal(arrays.shapes(), [values(data)[k].shape for k in arrays.keys()], err_msg=name)
        assert hdf5_calls["listed"] >= 1 and sorted(hdf5_calls["opened"]) == sorted(data), name
        assert index_file(path).read_bytes() != content, name  # replaced by a good one
        with np.load(index_file(path)) as saved:
            np.testing.assert_array_equal(saved["offsets"], fields["offsets"], err_msg=name)


def test_a_cache_that_cannot_be_written_changes_nothing_but_the_speed(tmp_path, cache):
    cache.parent.mkdir(exist_ok=True)
    cache.write_text("a file where the cache folder should be")
    path = tmp_path / "q.hdf5"
    data = toy()
    write(path, data)
    arrays = H5Arrays(path)
    np.testing.assert_array_equal(arrays.shapes(), [values(data)[k].shape for k in arrays.keys()])
    np.testing.assert_array_equal(arrays.read("v1#enc#1"), values(data)["v1#enc#1"])
    assert not list(tmp_path.glob("**/*.npz"))
    arrays.close()


def test_prune_keeps_the_most_recently_used(tmp_path):
    folder = tmp_path / "idx"
    folder.mkdir()
    for i in range(6):
        (folder / f"{i}.npz").write_bytes(b"x")
        os.utime(folder / f"{i}.npz", ns=(i * 10**9, i * 10**9))
    (folder / ".tmp-writer.npz").write_bytes(b"x")  # another process's file being written
    os.utime(folder / ".tmp-writer.npz", ns=(0, 0))
    prune(folder, 4)
    assert sorted(p.name for p in folder.iterdir()) == [".tmp-writer.npz", "2.npz", "3.npz", "4.npz", "5.npz"]
    prune(folder, 4)
    assert len(list(folder.iterdir())) == 5


def test_loading_an_index_marks_it_used(tmp_path):
    path = tmp_path / "q.hdf5"
    write(path, {"a": np.zeros((2, 3), np.float32)})
    H5Arrays(path).shapes()
    os.utime(index_file(path), ns=(0, 0))
    H5Arrays(path)
    assert index_file(path).stat().st_mtime_ns > 0


def test_keys_survive_the_round_trip(tmp_path):
    keys = ["café\xa0b#enc#0", "with space", "v#1", "ünï/code", ""]
    index = H5Index(keys=keys, stamp=(1, 2, 3, 4))
    index.shapes[1] = (3, 7)
    index.offsets[1] = 4096
    path = tmp_path / "any"
    index.save(path)
    loaded = H5Index.load(path, (1, 2, 3, 4))
    assert loaded.keys == keys and loaded.position == {k: i for i, k in enumerate(keys)}
    np.testing.assert_array_equal(loaded.shapes, index.shapes)
    np.testing.assert_array_equal(loaded.offsets, index.offsets)
    assert H5Index.load(path, (1, 2, 3, 5)) is None
    empty = H5Index(keys=[], stamp=(1, 2, 3, 4))
    empty.save(path)
    assert H5Index.load(path, (1, 2, 3, 4)).keys == []


# ---------------------------------------------------------------- BigFile


@pytest.fixture
def bigfile(tmp_path, files):
    """Rows stored out of video order (one video a contiguous run, one not); ids with '#' and latin-1 characters."""
    ids = ["a_f0", "a_f1", "a_f2", "café\xa0b_1", "unused", "café\xa0b_0", "c#enc_f0"]
    matrix = np.arange(7 * 3, dtype=np.float32).reshape(7, 3)
    v2f = {"a": ["a_f0", "a_f1", "a_f2"], "café\xa0b": ["café\xa0b_0", "café\xa0b_1"], "c#enc": ["c#enc_f0"], "none": []}
    return files.write_bigfile(tmp_path / "bf", ids, matrix, v2f), matrix


@pytest.fixture
def text_reads(monkeypatch):
    """How many times id.txt and video2frames.txt are parsed."""
    from prvrlab.data import bigfile as module

    calls = []
    for name in ("read_frame_ids", "read_video2frames"):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda path, _real=real, _name=name: calls.append(_name) or _real(path))
    return calls


def tables(bf):
    return bf.video_ids(), bf._index, bf._offsets.tolist(), bf._rows.tolist(), bf._contiguous.tolist()


def test_a_bigfile_opened_again_parses_no_text_and_agrees_with_a_fresh_index(bigfile, text_reads, cache):
    from prvrlab.data.bigfile import BigFile

    folder, matrix = bigfile
    first = BigFile(folder)
    assert text_reads == ["read_frame_ids", "read_video2frames"]
    assert first._contiguous.tolist() == [True, False, True, True]
    second = BigFile(folder)
    assert text_reads == ["read_frame_ids", "read_video2frames"]  # nothing parsed the second time
    assert tables(second) == tables(first)
    np.testing.assert_array_equal(second.frames("café\xa0b"), matrix[[5, 3]])
    np.testing.assert_array_equal(second.frames("a"), matrix[[0, 1, 2]])
    assert second.frame_counts() == {"a": 3, "café\xa0b": 2, "c#enc": 1, "none": 0}
    assert second.videos_of_row(3) == ["café\xa0b"]
    (cache / "data-index").rename(cache / "elsewhere")  # no index: a fresh walk gives the same
    assert tables(BigFile(folder)) == tables(second)


def test_a_changed_bigfile_is_indexed_again(bigfile, text_reads):
    from prvrlab.data.bigfile import BigFile

    folder, matrix = bigfile
    BigFile(folder)
    (folder / "video2frames.txt").write_bytes(repr({"a": ["a_f2", "a_f0"], "d": ["unused"]}).encode("latin-1"))
    changed = BigFile(folder)
    assert len(text_reads) == 4
    assert changed.video_ids() == ["a", "d"]
    np.testing.assert_array_equal(changed.frames("a"), matrix[[2, 0]])
    np.testing.assert_array_equal(changed.frames("d"), matrix[[4]])


def test_a_bigfile_rewritten_in_place_with_its_old_mtime_put_back_is_indexed_again(bigfile, text_reads):
    """``cp -p`` over the file, ``rsync -t --inplace`` or ``touch -r``: same inode, size and mtime."""
    import time

    from prvrlab.data.bigfile import BigFile

    folder, matrix = bigfile
    assert BigFile(folder).frames("a").tolist() == matrix[[0, 1, 2]].tolist()
    ids = folder / "id.txt"
    before = os.stat(ids)
    time.sleep(0.01)  # a later change time, also on file systems with coarse clocks
    swapped = ids.read_bytes().replace(b"a_f0", b"a_fX").replace(b"a_f2", b"a_f0").replace(b"a_fX", b"a_f2")
    with open(ids, "r+b") as f:
        f.write(swapped)
    os.utime(ids, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(ids)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    reread = BigFile(folder)
    assert len(text_reads) == 4  # parsed again
    np.testing.assert_array_equal(reread.frames("a"), matrix[[2, 1, 0]])  # the rows now named a_f0..a_f2


def test_a_bad_bigfile_is_refused_every_time(tmp_path, files):
    from prvrlab.data.bigfile import BigFile

    folder = files.write_bigfile(tmp_path / "bf", ["x_f0"], np.zeros((1, 2), np.float32), {"x": ["x_f0", "x_f9"]})
    for _ in range(2):
        with pytest.raises(DataError, match="frame id 'x_f9' of video 'x' is not in"):
            BigFile(folder)
    assert not list(index_cache.index_dir().glob("bigfile-*"))


def test_a_saved_bigfile_index_that_does_not_fit_is_ignored(bigfile, text_reads):
    from prvrlab.data.bigfile import INDEX_KIND, BigFile

    folder, matrix = bigfile
    good = tables(BigFile(folder))
    target = index_cache.index_file(INDEX_KIND, folder)
    with np.load(target) as saved:
        fields = dict(saved)
    broken = {
        "a row past the end": {**fields, "rows": np.where(fields["rows"] == 6, 7, fields["rows"])},
        "a negative row": {**fields, "rows": fields["rows"] - 1},
        "offsets not rising": {**fields, "offsets": fields["offsets"][::-1].copy()},
        "one video too many": {**fields, "count": fields["count"] + 1},
        "no runs": {k: v for k, v in fields.items() if k != "contiguous"},
    }
    for name, content in broken.items():
        with open(target, "wb") as fh:
            np.savez(fh, **content)
        before = len(text_reads)
        assert tables(BigFile(folder)) == good, name
        assert len(text_reads) == before + 2, name  # walked again, and the good index saved back
        with np.load(target) as saved:
            np.testing.assert_array_equal(saved["rows"], fields["rows"], err_msg=name)
