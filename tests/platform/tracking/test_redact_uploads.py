"""URL passwords never reach what every reader of the store sees: uploaded text artifacts, the config
saved in best_model.pt, the console's store lines and the CLI's error lines. Local files keep what the
user gave."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from prvrlab.platform import cli
from prvrlab.platform.config import ConfigError, validate
from prvrlab.platform.tracking.store import Tracker
from prvrlab.platform.train.loop import TrainingLoop
from prvrlab.platform.train.session import LocalSession
from prvrlab.uris import redact_nested

from train_helpers import small_raw

SECRET_URI = "postgresql://alice:s3cret@db.lab/mlflow"


@pytest.fixture
def tracker(tmp_path):
    return Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "tests")


def uploaded(tracker: Tracker, run_id: str, name: str, dst: Path) -> bytes:
    return Path(tracker.client.download_artifacts(run_id, name, str(dst))).read_bytes()


def test_text_artifacts_go_up_with_the_password_masked_and_the_local_file_kept(tracker, tmp_path):
    run_id = tracker.start_run("r")
    config = tmp_path / "config.yaml"
    written = f"tracking:\r\n  uri: {SECRET_URI}\r\n  experiment: x\r\n".encode()
    config.write_bytes(written)
    plain = tmp_path / "notes.txt"
    plain.write_bytes("nothing to hide: https://mlflow.lab/#/runs\r\n".encode())
    weights = tmp_path / "w.pt"
    weights.write_bytes(b"\x80\x02" + SECRET_URI.encode())  # not a text file this reads: goes up as it is
    tracker.log_artifacts(run_id, [config, plain, weights])

    expected = written.replace(b"alice:s3cret@", b"alice:***@")  # the line endings kept as written
    assert uploaded(tracker, run_id, "config.yaml", tmp_path / "d1") == expected
    assert uploaded(tracker, run_id, "notes.txt", tmp_path / "d2") == plain.read_bytes()
    assert uploaded(tracker, run_id, "w.pt", tmp_path / "d3") == weights.read_bytes()
    assert config.read_bytes() == written
    tracker.end_run(run_id, "FINISHED")


def test_an_artifact_folder_keeps_its_name(tracker, tmp_path):
    run_id = tracker.start_run("r")
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"base: configs/x.yaml\ntracking_uri: {SECRET_URI}\n")
    tracker.log_artifacts(run_id, [spec], "spec")
    names = [f.path for f in tracker.client.list_artifacts(run_id, "spec")]
    assert names == ["spec/spec.yaml"]
    assert b"s3cret" not in uploaded(tracker, run_id, "spec/spec.yaml", tmp_path / "d")
    tracker.end_run(run_id, "FINISHED")


def test_redact_nested_masks_every_string_of_a_config():
    config = {"tracking": {"uri": SECRET_URI, "experiment": "x"}, "list": ["s3://k:v@minio/b", 3], "n": 1.5}
    assert redact_nested(config) == {
        "tracking": {"uri": "postgresql://alice:***@db.lab/mlflow", "experiment": "x"},
        "list": ["s3://k:***@minio/b", 3],
        "n": 1.5,
    }


def test_best_model_holds_the_config_with_the_password_masked(tiny_root, tmp_path):
    raw = small_raw(tiny_root, tmp_path, epochs=1)
    raw["tracking"]["uri"] = "https://alice:s3cret@mlflow.lab:5000"  # the loop itself opens no store
    cfg = validate(raw)
    TrainingLoop(cfg, session=LocalSession(tmp_path / "session"), run_dir=tmp_path / "run").run()
    blob = torch.load(tmp_path / "run" / "best_model.pt", map_location="cpu", weights_only=True)
    assert blob["config"]["tracking"]["uri"] == "https://alice:***@mlflow.lab:5000"
    assert {k: v for k, v in blob["config"].items() if k != "tracking"} == {
        k: v for k, v in cfg.to_dict().items() if k != "tracking"
    }


def test_the_cli_error_line_masks_the_password(monkeypatch, capsys):
    def fails(args):
        raise ConfigError(f"tracking.uri {SECRET_URI}: cannot use this MLflow store: refused")

    monkeypatch.setattr(cli, "cmd_recipes", fails)
    assert cli.main(["recipes"]) == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "alice:***@db.lab" in err and "s3cret" not in err


def test_a_folder_goes_up_file_by_file_masked_at_its_relative_places(tracker, tmp_path):
    run_id = tracker.start_run("r")
    folder = tmp_path / "report"
    (folder / "figures").mkdir(parents=True)
    (folder / "report.md").write_text(f"store {SECRET_URI}\n")
    (folder / "figures" / "notes.txt").write_bytes(b"caf\xe9 " + SECRET_URI.encode() + b"\n")  # latin-1, not UTF-8
    tracker.log_artifacts(run_id, [folder], "report")
    names = sorted(f.path for f in tracker.client.list_artifacts(run_id, "report"))
    assert names == ["report/figures", "report/report.md"]
    assert uploaded(tracker, run_id, "report/report.md", tmp_path / "d1") == b"store postgresql://alice:***@db.lab/mlflow\n"
    assert uploaded(tracker, run_id, "report/figures/notes.txt", tmp_path / "d2") == b"caf\xe9 postgresql://alice:***@db.lab/mlflow\n"
    tracker.end_run(run_id, "FINISHED")


def test_a_password_holding_at_signs_is_masked_whole():
    from prvrlab.uris import redact_credentials

    assert redact_credentials("postgresql://u:p@ss@h/db") == "postgresql://u:***@h/db"
    assert redact_credentials("http://h:5000/x@y") == "http://h:5000/x@y"  # a port, then a path: nothing to mask
    assert redact_credentials("https://u:p@h/a@b c://d:e@f") == "https://u:***@h/a@b c://d:***@f"
