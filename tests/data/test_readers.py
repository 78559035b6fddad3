"""Readers on files written by hand, checked value by value."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from prvrlab.data.bigfile import BigFile, read_video2frames
from prvrlab.data.errors import DataError
from prvrlab.data.features import HDF5Features, VisualFeatures, open_visual_features
from prvrlab.data.text import QueryFeatures, moment_ratios, read_captions, read_timestamps, video_id_of


@pytest.fixture
def bigfile_dir(tmp_path, files):
    # Rows are stored in an order unrelated to the videos; ids contain '#' and latin-1 characters.
    ids = ["v_x#enc#0_f1", "café\xa0b_0", "v_x#enc#0_f0", "café\xa0b_1", "unused", "v_x#enc#0_f2"]
    matrix = np.arange(6 * 3, dtype=np.float32).reshape(6, 3) * 0.5  # row r = [1.5 r, 1.5 r + .5, 1.5 r + 1]
    v2f = {
        "v_x#enc#0": ["v_x#enc#0_f0", "v_x#enc#0_f1", "v_x#enc#0_f2"],
        "café\xa0b": ["café\xa0b_1", "café\xa0b_0"],
    }
    return files.write_bigfile(tmp_path / "bf", ids, matrix, v2f), matrix


def test_bigfile_reads_exact_rows_in_video2frames_order(bigfile_dir):
    folder, matrix = bigfile_dir
    bf = BigFile(folder)
    assert bf.dim == 3 and bf.num_rows == 6 and len(bf) == 2
    assert bf.video_ids() == ["v_x#enc#0", "café\xa0b"]
    np.testing.assert_array_equal(bf.frames("v_x#enc#0"), matrix[[2, 0, 5]])
    np.testing.assert_array_equal(bf.frames("café\xa0b"), matrix[[3, 1]])
    assert bf.frames("v_x#enc#0").dtype == np.float32
    assert bf.num_frames("café\xa0b") == 2
    assert bf.frame_counts() == {"v_x#enc#0": 3, "café\xa0b": 2}
    assert bf.has("v_x#enc#0") and not bf.has("v_x")
    assert isinstance(bf, VisualFeatures)


def test_bigfile_contiguous_runs_read_as_slices(tmp_path, files):
    """Videos whose rows are one ascending run (read as a slice) and videos that are not (gathered):
    both give the rows of video2frames.txt, also a one-frame video, a run at the file's end and a
    descending pair."""
    ids = [f"f{r}" for r in range(8)]
    matrix = np.arange(8 * 2, dtype=np.float32).reshape(8, 2)
    v2f = {"run": ["f1", "f2", "f3"], "back": ["f5", "f4"], "one": ["f0"], "gap": ["f0", "f2"], "tail": ["f6", "f7"]}
    bf = BigFile(files.write_bigfile(tmp_path / "bf", ids, matrix, v2f))
    assert bf._contiguous.tolist() == [True, False, True, False, True]
    for video, rows in {"run": [1, 2, 3], "back": [5, 4], "one": [0], "gap": [0, 2], "tail": [6, 7]}.items():
        got = bf.frames(video)
        np.testing.assert_array_equal(got, matrix[rows])
        assert got.dtype == np.float32 and not np.shares_memory(got, bf._memmap())  # a copy, not a view of the map


def test_bigfile_runs_read_without_a_memory_map(tmp_path, files):
    """A run of rows is read by positioned reads into its array: no memory map is opened (its touched
    pages would stay in the resident set); the descriptor is not pickled and close() drops it."""
    ids = [f"f{r}" for r in range(5)]
    matrix = np.arange(5 * 4, dtype=np.float32).reshape(5, 4) - 7.25
    bf = BigFile(files.write_bigfile(tmp_path / "bf", ids, matrix, {"a": ["f0", "f1"], "b": ["f2", "f3", "f4"]}))
    np.testing.assert_array_equal(bf.frames("b"), matrix[2:5])
    np.testing.assert_array_equal(bf.frames("a"), matrix[0:2])
    assert bf._mm is None and bf._fd is not None
    clone = pickle.loads(pickle.dumps(bf))
    assert clone._fd is None
    np.testing.assert_array_equal(clone.frames("b"), matrix[2:5])
    bf.close()
    assert bf._fd is None
    np.testing.assert_array_equal(bf.frames("a"), matrix[0:2])  # reopened


def test_bigfile_unknown_video_names_file(bigfile_dir):
    bf = BigFile(bigfile_dir[0])
    with pytest.raises(DataError, match="video2frames.txt.*'nope'"):
        bf.frames("nope")


def test_bigfile_pickles_without_memmap(bigfile_dir):
    folder, matrix = bigfile_dir
    bf = BigFile(folder)
    bf.frames("v_x#enc#0")  # opens the memory map
    blob = pickle.dumps(bf)
    assert len(blob) < 5000  # the features themselves are not pickled
    clone = pickle.loads(blob)
    np.testing.assert_array_equal(clone.frames("café\xa0b"), matrix[[3, 1]])


def test_open_visual_features_picks_reader(bigfile_dir, tmp_path, files):
    assert isinstance(open_visual_features(bigfile_dir[0]), BigFile)
    path = files.write_h5(tmp_path / "v.h5", {"a": np.ones((2, 3), np.float32)})
    assert isinstance(open_visual_features(path), HDF5Features)
    with pytest.raises(DataError, match="not found.*missing.h5"):
        open_visual_features(tmp_path / "missing.h5")


def test_video2frames_fast_path_equals_literal_eval(tmp_path):
    # Quotes, backslashes and trailing commas take the literal_eval path; plain text the JSON path.
    cases = {
        "plain.txt": "{'a': ['a_0', 'a_1'], 'b#1': []}",
        "dq.txt": '{"it\'s": ["x"], \'b\': [\'y\',]}',
        "bs.txt": "{'a\\\\b': ['f\\'0'], 'c': ('d',),}",
    }
    expected = {
        "plain.txt": {"a": ["a_0", "a_1"], "b#1": []},
        "dq.txt": {"it's": ["x"], "b": ["y"]},
        "bs.txt": {"a\\b": ["f'0"], "c": ("d",)},
    }
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
        assert read_video2frames(tmp_path / name) == expected[name]


def test_video2frames_plain_text_skips_the_syntax_tree(tmp_path, monkeypatch):
    import prvrlab.data.bigfile as bigfile

    def no_literal_eval(text):
        raise AssertionError("the JSON fast path should have been used")

    monkeypatch.setattr(bigfile.ast, "literal_eval", no_literal_eval)
    (tmp_path / "v2f.txt").write_text("{'v_1#enc': ['v_1#enc_0'], 'café': []}\n", encoding="latin-1")
    assert read_video2frames(tmp_path / "v2f.txt") == {"v_1#enc": ["v_1#enc_0"], "café": []}


def test_video2frames_entries_must_be_strings(tmp_path):
    (tmp_path / "ints.txt").write_text("{'a': ['a0'], 'b': [1, 2]}")
    with pytest.raises(DataError, match="ints.txt: entry 'b'"):
        read_video2frames(tmp_path / "ints.txt")


def test_video2frames_is_never_evaluated(tmp_path):
    (tmp_path / "evil.txt").write_text("__import__('os').system('echo pwned')")
    with pytest.raises(DataError, match="evil.txt.*not a Python dict literal"):
        read_video2frames(tmp_path / "evil.txt")


def test_hdf5_features_exact_values(tmp_path, files):
    a = np.arange(12, dtype=np.float32).reshape(4, 3)
    b = np.full((1, 3), -2.5, dtype=np.float64)  # converted to float32 on read
    path = files.write_h5(tmp_path / "feat.hdf5", {"v#1": a, "v2": b})
    feats = HDF5Features(path)
    assert feats.dim == 3 and feats.video_ids() == ["v#1", "v2"]
    assert feats.frame_counts() == {"v#1": 4, "v2": 1}
    np.testing.assert_array_equal(feats.frames("v#1"), a)
    out = feats.frames("v2")
    assert out.dtype == np.float32 and out.tolist() == [[-2.5, -2.5, -2.5]]
    clone = pickle.loads(pickle.dumps(feats))  # open handle is dropped, reopened lazily
    np.testing.assert_array_equal(clone.frames("v#1"), a)
    with pytest.raises(DataError, match="feat.hdf5.*'zz'"):
        feats.frames("zz")


def test_captions_split_on_first_space(tmp_path):
    path = tmp_path / "ctrain.caption.txt"
    path.write_text("v_a#enc#0 A man  opens the door.\n\nv_b#1 one\nv_c#0\n")
    caps = read_captions(path)
    assert caps == [("v_a#enc#0", "A man  opens the door."), ("v_b#1", "one"), ("v_c#0", "")]
    assert [video_id_of(c) for c, _ in caps] == ["v_a", "v_b", "v_c"]
    assert video_id_of("plain") == "plain"


@pytest.mark.parametrize("ending", ["\n", "\r\n", "\r"])
def test_captions_are_read_with_any_line_ending_as_text_mode_reads_them(tmp_path, ending):
    """The reference reads caption files in text mode, where a lone CR (old Mac files) ends a line too."""
    lines = ["v1#0 caption number 0", "v2#0 caption number 1", "", "v3#0 caption number 2", "v3#1 caption number 3"]
    path = tmp_path / "ctrain.caption.txt"
    path.write_bytes(ending.join(lines).encode() + ending.encode())
    with path.open(encoding="utf-8") as f:  # Python's text mode: universal newlines
        expected = [tuple(line.strip().split(" ", 1)) for line in f if line.strip()]
    assert read_captions(path) == expected and len(expected) == 4


def test_a_byte_order_mark_is_not_part_of_the_first_caption_id(tmp_path):
    path = tmp_path / "ctrain.caption.txt"
    path.write_bytes("\ufeffv1#0 une légende\nv2#0 two\n".encode("utf-8"))
    assert read_captions(path) == [("v1#0", "une légende"), ("v2#0", "two")]
    path.write_bytes(b"v1#0 ok\r\nv2#0 \xff bad\r\n")
    with pytest.raises(DataError, match=r"ctrain.caption.txt: line 2: not UTF-8 text \(byte 0xff at column 6\)"):
        read_captions(path)


def test_duplicate_caption_id(tmp_path):
    path = tmp_path / "cval.caption.txt"
    path.write_text("a#0 x\nb#0 y\na#0 z\n")
    with pytest.raises(DataError, match="cval.caption.txt.*'a#0'"):
        read_captions(path)


def test_query_features(tmp_path, files):
    q0 = np.arange(8, dtype=np.float32).reshape(2, 4)
    path = files.write_h5(tmp_path / "q.hdf5", {"a#0": q0, "a#1": np.ones((5, 4)), "b#0": np.ones((3, 4))})
    qf = QueryFeatures(path)
    assert qf.dim == 4 and len(qf) == 3 and "a#1" in qf
    np.testing.assert_array_equal(qf.tokens("a#0"), q0)
    assert qf.check(["b#0", "a#0", "a#1"]).tolist() == [3, 2, 5]
    assert qf.missing(["a#0", "zz", "b#0"]) == ["zz"]


def test_timestamps_and_ratios(tmp_path):
    path = tmp_path / "ts.json"
    path.write_text('{"a#0": [1.0, 3.0, 10.0], "a#1": [0, 10, 10]}')
    stamps = read_timestamps(path)
    assert stamps == {"a#0": (1.0, 3.0, 10.0), "a#1": (0.0, 10.0, 10.0)}
    r = moment_ratios(stamps, ["a#1", "zz", "a#0"])
    np.testing.assert_allclose(r[[0, 2]], [1.0, 0.2])
    assert np.isnan(r[1])
    assert read_timestamps(tmp_path / "absent.json") is None
    path.write_text('{"a#0": [1.0, 3.0]}')
    with pytest.raises(DataError, match="ts.json.*'a#0'"):
        read_timestamps(path)


def test_h5_arrays_read_contiguous_float32_runs_directly_and_the_rest_through_hdf5(tmp_path, monkeypatch):
    import os

    import h5py

    from prvrlab.data.features import H5Arrays

    rng = np.random.default_rng(0)
    values = {name: rng.standard_normal((n, 5)).astype(np.float32) for name, n in
              (("plain", 3), ("big_endian", 4), ("chunked", 6), ("gzip", 2), ("half", 3), ("double", 2))}
    path = tmp_path / "q.hdf5"
    with h5py.File(path, "w") as f:
        f.create_dataset("plain", data=values["plain"])
        f.create_dataset("big_endian", data=values["big_endian"].astype(">f4"))
        f.create_dataset("chunked", data=values["chunked"], chunks=(2, 5))
        f.create_dataset("gzip", data=values["gzip"], compression="gzip")
        f.create_dataset("half", data=values["half"].astype(np.float16))
        f.create_dataset("double", data=values["double"].astype(np.float64))
    arrays = H5Arrays(path)
    assert arrays.shapes().tolist() == [[len(values[k]), 5] for k in arrays.keys()]
    assert set(arrays._runs) == {"plain"}  # the only contiguous little-endian float32 dataset
    positioned = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda *a: positioned.append(a[2]) or real(*a))
    for name, want in values.items():
        want = want.astype(np.float16) if name == "half" else want
        got = arrays.read(name)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, want.astype(np.float32))
    assert len(positioned) == 1  # "plain" only, at its offset in the file
    with h5py.File(path, "r") as f:
        assert positioned == [f["plain"].id.get_offset()]
    clone = pickle.loads(pickle.dumps(arrays))  # no descriptor travels; the clone opens its own
    assert clone._fd is None
    np.testing.assert_array_equal(clone.read("plain"), values["plain"])
    arrays.close()
    clone.close()
    assert arrays._fd is None and len(positioned) == 2


def test_h5_arrays_forget_their_runs_when_the_file_is_replaced(tmp_path):
    import os

    import h5py

    from prvrlab.data.features import H5Arrays

    path = tmp_path / "q.hdf5"
    with h5py.File(path, "w") as f:
        f.create_dataset("a", data=np.zeros((2, 3), np.float32))
    arrays = H5Arrays(path)
    arrays.shapes()
    assert "a" in arrays._runs
    fresh = tmp_path / "new.hdf5"
    with h5py.File(fresh, "w") as f:
        f.create_dataset("pad", data=np.ones((50, 3), np.float32))  # "a" lies elsewhere in the new file
        f.create_dataset("a", data=np.full((2, 3), 7.0, np.float32))
    os.replace(fresh, path)
    # not the new file's bytes at the old offset: through HDF5's handle, still on the file it opened
    np.testing.assert_array_equal(arrays.read("a"), np.zeros((2, 3), np.float32))
    assert arrays._runs == {}
    arrays.close()
    np.testing.assert_array_equal(arrays.read("a"), np.full((2, 3), 7.0, np.float32))  # a new handle: the new file


def test_a_utf8_video2frames_gives_the_video_ids_the_captions_name(tmp_path):
    """UTF-8 video ids (as the official reader's ``open()`` and the captions read them) had been decoded as
    latin-1 ('cafÃ©'), so no caption found its video; frame ids still match id.txt's latin-1 reading."""
    folder = tmp_path / "bf"
    folder.mkdir()
    matrix = np.arange(4 * 2, dtype=np.float32).reshape(4, 2)
    frames = ["café_1", "plain_0", "café_0", "ñ"]  # id.txt: the same bytes as video2frames.txt's (UTF-8)
    (folder / "feature.bin").write_bytes(matrix.astype("<f4").tobytes())
    (folder / "shape.txt").write_text("4 2\n")
    (folder / "id.txt").write_bytes(" ".join(frames).encode("utf-8"))
    (folder / "video2frames.txt").write_bytes(repr({"café": ["café_0", "café_1"], "plain": ["plain_0", "ñ"]}).encode("utf-8"))
    bf = BigFile(folder)
    assert bf.video_ids() == ["café", "plain"]
    np.testing.assert_array_equal(bf.frames("café"), matrix[[2, 0]])
    np.testing.assert_array_equal(bf.frames("plain"), matrix[[1, 3]])


def test_a_utf8_frame_id_in_an_error_is_spelled_as_its_file_spells_it(tmp_path):
    """id.txt is read as latin-1: the message had shown 'cafÃ©_1'."""
    folder = tmp_path / "bf"
    folder.mkdir()
    (folder / "feature.bin").write_bytes(np.zeros((1, 2), dtype="<f4").tobytes())
    (folder / "shape.txt").write_text("1 2\n")
    (folder / "id.txt").write_bytes("café_0".encode("utf-8"))
    (folder / "video2frames.txt").write_bytes(repr({"café": ["café_0", "café_1"]}).encode("utf-8"))
    with pytest.raises(DataError, match="frame id 'café_1' of video 'café' is not in"):
        BigFile(folder)
