"""Every corrupted input raises DataError naming the file (and the id)."""

from __future__ import annotations

import ast
import dataclasses
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest

from prvrlab.data.collection import open_collection
from prvrlab.data.errors import DataError
from prvrlab.data.inspect import inspect_collection


def _feat(cfg):
    return Path(cfg.root) / "FeatureData" / "feat"


def _text(cfg):
    return Path(cfg.root) / "TextData"


def _truncate_bin(cfg):
    path = _feat(cfg) / "feature.bin"
    path.write_bytes(path.read_bytes()[:-4])
    return r"feature\.bin: size \d+ bytes disagrees with shape\.txt"


def _bad_shape_txt(cfg):
    (_feat(cfg) / "shape.txt").write_text("12\n")
    return r"shape\.txt"


def _short_id_txt(cfg):
    path = _feat(cfg) / "id.txt"
    path.write_text(" ".join(path.read_text().split()[:-1]))
    return r"id\.txt: \d+ frame ids, but shape\.txt says N="


def _unknown_frame(cfg):
    path = _feat(cfg) / "video2frames.txt"
    path.write_text(path.read_text().replace("'vB/7'", "'vB/x'"))
    return r"video2frames\.txt: frame id 'vB/x' of video 'vB' is not in .*id\.txt"


def _v2f_not_dict(cfg):
    (_feat(cfg) / "video2frames.txt").write_text("['vA']")
    return r"video2frames\.txt: expected a dict"


def _missing_bin(cfg):
    (_feat(cfg) / "feature.bin").unlink()
    return r"missing file .*feature\.bin"


def _missing_visual(cfg):
    shutil.rmtree(_feat(cfg))
    return r"visual features not found: .*FeatureData/feat"


def _missing_caption(cfg):
    (_text(cfg) / "toyval.caption.txt").unlink()
    return r"split 'val' not found in .*TextData; splits with captions: train$"


def _missing_query_file(cfg):
    (_text(cfg) / "roberta_toy_query_feat.hdf5").unlink()
    return r"query features file not found: .*roberta_toy_query_feat\.hdf5"


def _caption_without_video(cfg):
    with (_text(cfg) / "toytrain.caption.txt").open("a") as f:
        f.write("vZ#0 a video nobody extracted\n")
    return r"toytrain\.caption\.txt: caption 'vZ#0' refers to video 'vZ', which has no features in .*feat"


def _query_without_features(cfg):
    with (_text(cfg) / "toyval.caption.txt").open("a") as f:
        f.write("vD#9 no features for me\n")
    return r"roberta_toy_query_feat\.hdf5: query id 'vD#9' has no features \(captions: .*toyval\.caption\.txt\)"


def _query_dim_mismatch(cfg):
    with h5py.File(_text(cfg) / "roberta_toy_query_feat.hdf5", "a") as f:
        del f["vB#1"]
        f.create_dataset("vB#1", data=np.ones((4, 5), np.float32))
    return r"roberta_toy_query_feat\.hdf5: query 'vB#1' has dimension 5, but query '.*' has 4"


def _query_no_token(cfg):
    with h5py.File(_text(cfg) / "roberta_toy_query_feat.hdf5", "a") as f:
        del f["vD#1"]
        f.create_dataset("vD#1", data=np.ones((0, 4), np.float32))
    return r"roberta_toy_query_feat\.hdf5: query 'vD#1' has no token"


def _query_file_not_hdf5(cfg):
    (_text(cfg) / "roberta_toy_query_feat.hdf5").write_text("not hdf5")
    return r"roberta_toy_query_feat\.hdf5: cannot open as HDF5"


def _empty_video(cfg):
    path = _feat(cfg) / "video2frames.txt"
    v2f = ast.literal_eval(path.read_text())
    v2f["vC"] = []
    path.write_text(repr(v2f))
    return r"feat(/video2frames\.txt)?: video 'vC' has no frame"


CORRUPTIONS = [
    _truncate_bin,
    _bad_shape_txt,
    _short_id_txt,
    _unknown_frame,
    _v2f_not_dict,
    _missing_bin,
    _missing_visual,
    _missing_caption,
    _missing_query_file,
    _caption_without_video,
    _query_without_features,
    _query_dim_mismatch,
    _query_no_token,
    _query_file_not_hdf5,
    _empty_video,
]


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("entry", ["open_collection", "inspect_collection"])
def test_corruption_raises_data_error(toy_cfg, corrupt, entry):
    pattern = corrupt(toy_cfg)
    fn = open_collection if entry == "open_collection" else inspect_collection
    with pytest.raises(DataError, match=pattern):
        fn(toy_cfg)


def test_hdf5_video_dim_mismatch(tmp_path, files):
    cfg = files.make_collection(tmp_path / "h5", files.toy_videos, files.toy_captions, fmt="hdf5")
    with h5py.File(tmp_path / "h5" / "FeatureData" / "feat.hdf5", "a") as f:
        del f["vC"]
        f.create_dataset("vC", data=np.ones((3, 7), np.float32))
    for fn in (open_collection, inspect_collection):
        with pytest.raises(DataError, match=r"feat\.hdf5: video 'vC' has dimension 7, but video 'vA' has 6"):
            fn(cfg)


def test_missing_root(tmp_path, toy_cfg):
    cfg = dataclasses.replace(toy_cfg, root=str(tmp_path / "nowhere"))
    with pytest.raises(DataError, match="data root not found: .*nowhere"):
        open_collection(cfg)
