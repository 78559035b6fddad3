"""Folders where a file is expected: a config path that is a folder says so; ``eval`` on the run folder that
training prints takes its ``files/best_model.pt``, and a folder with none lists the recovery checkpoints it has."""

from __future__ import annotations

import pytest

from prvrlab.data.errors import DataError
from prvrlab.platform.cli import EXIT_BAD_INPUT, main
from prvrlab.platform.config import ConfigError, load_config
from prvrlab.platform.train.checkpoint_eval import checkpoint_file


def test_a_config_path_that_is_a_folder_is_named_as_one(tmp_path, capsys):
    with pytest.raises(ConfigError, match=rf"^config file {tmp_path} is a folder: give the YAML file in it$"):
        load_config(tmp_path)
    assert main(["train", str(tmp_path), "--check"]) == EXIT_BAD_INPUT
    assert capsys.readouterr().err == f"prvrlab: error: config file {tmp_path} is a folder: give the YAML file in it\n"


def test_a_run_folder_is_its_files_best_model(tmp_path):
    best = tmp_path / "files" / "best_model.pt"
    best.parent.mkdir()
    best.write_bytes(b"x")
    (tmp_path / "checkpoint_000001").mkdir()
    (tmp_path / "checkpoint_000001" / "state.pt").write_bytes(b"x")
    assert checkpoint_file(tmp_path) == best
    assert checkpoint_file(best.parent) == best  # the files folder itself, as before


def test_a_folder_without_a_model_lists_its_recovery_checkpoints(tmp_path):
    for name in ("checkpoint_000002", "checkpoint_000001"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "state.pt").write_bytes(b"x")
    (tmp_path / "checkpoint_empty").mkdir()
    with pytest.raises(DataError) as err:
        checkpoint_file(tmp_path)
    assert "its recovery checkpoints: checkpoint_000001, checkpoint_000002:" in str(err.value)
    assert "checkpoint_empty" not in str(err.value)
