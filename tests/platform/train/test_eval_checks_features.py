"""``prvrlab eval`` refuses features with a NaN, as training does (it scored the video -inf, silently)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from prvrlab.data.errors import DataError
from prvrlab.platform.config import validate
from prvrlab.platform.train.checkpoint_eval import evaluate_checkpoint
from prvrlab.platform.train.loop import run_local

from train_helpers import small_raw


def test_checkpoint_evaluation_refuses_a_nan_frame_naming_the_file(tiny_root, tmp_path, monkeypatch):
    monkeypatch.setenv("PRVRLAB_CACHE_DIR", str(tmp_path / "cache"))
    run_local(validate(small_raw(tiny_root, tmp_path, epochs=1)), tmp_path / "run")
    best = tmp_path / "run" / "best_model.pt"
    data = tmp_path / "data"
    shutil.copytree(tiny_root, data)
    assert evaluate_checkpoint(best, split="val", data_root=data).table.num_rows > 0  # the copy evaluates
    features = data / "FeatureData" / "synth_feat" / "feature.bin"
    values = np.fromfile(features, dtype="<f4")
    values[len(values) // 2] = np.nan
    values.tofile(features)
    with pytest.raises(DataError, match=rf"{features}.*NaN"):
        evaluate_checkpoint(best, split="val", data_root=data)
