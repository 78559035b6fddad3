"""An experiment whose artifact location cannot be written (under a file, or a read-only folder) is refused when
the store is opened, before any training: MLflow had failed only at the run's first artifact, after an epoch."""

from __future__ import annotations

import os

import mlflow
import pytest
import yaml

from prvrlab.platform.cli import EXIT_BAD_INPUT, main
from prvrlab.platform.config import ConfigError
from prvrlab.platform.tracking.store import Tracker

from train_helpers import small_raw


def _experiment_at(uri: str, name: str, location) -> None:
    mlflow.MlflowClient(tracking_uri=uri).create_experiment(name, artifact_location=location.as_uri())


def test_an_artifact_location_under_a_file_is_refused_naming_the_experiment(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    Tracker(uri, "fine")  # the store exists
    (tmp_path / "blocker").write_text("a file")
    location = tmp_path / "blocker" / "arts"
    _experiment_at(uri, "blocked", location)
    with pytest.raises(ConfigError) as caught:
        Tracker(uri, "blocked")
    assert str(caught.value) == (f"tracking.experiment 'blocked': its artifact location {location.as_uri()} cannot be "
                                 f"written: {tmp_path / 'blocker'} is a file, not a folder")
    _experiment_at(uri, "deep", tmp_path / "new" / "folders" / "arts")  # not there yet: MLflow makes them
    assert Tracker(uri, "deep").experiment_id


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_artifact_folder_is_refused(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    Tracker(uri, "fine")
    frozen = tmp_path / "frozen"
    frozen.mkdir()
    _experiment_at(uri, "ro", frozen / "arts")
    frozen.chmod(0o500)
    try:
        with pytest.raises(ConfigError, match="is not writable"):
            Tracker(uri, "ro")
    finally:
        frozen.chmod(0o700)


def test_training_into_it_stops_before_any_work_and_records_no_run(tiny_root, tmp_path, capsys):
    raw = small_raw(tiny_root, tmp_path, epochs=1)
    uri = raw["tracking"]["uri"]
    Tracker(uri, "fine")
    (tmp_path / "blocker").write_text("a file")
    _experiment_at(uri, raw["tracking"]["experiment"], tmp_path / "blocker" / "arts")
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["train", str(path), "--no-ray"]) == EXIT_BAD_INPUT
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "its artifact location" in err[0] and "is a file, not a folder" in err[0], err
    client = mlflow.MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(raw["tracking"]["experiment"])
    assert client.search_runs([experiment.experiment_id]) == []
    assert not (tmp_path / "results").exists() or not any((tmp_path / "results").iterdir())


@pytest.mark.parametrize("location", ["mlflow-artifacts:/1", "s3://bucket/x", "gs://bucket/x", "http://host/x", None, ""])
def test_remote_or_absent_locations_are_left_to_their_store(location):
    from prvrlab.platform.tracking.store import _artifact_problem

    assert _artifact_problem(location) is None


def test_relative_and_quoted_local_locations_are_checked_where_mlflow_writes(tmp_path, monkeypatch):
    from prvrlab.platform.tracking.store import _artifact_problem

    monkeypatch.chdir(tmp_path)
    (tmp_path / "a file").write_text("x")
    assert _artifact_problem("./mlruns/1") is None
    assert _artifact_problem((tmp_path / "a file" / "arts").as_uri()) == f"{tmp_path / 'a file'} is a file, not a folder"
    assert _artifact_problem("a file/arts") == "a file is a file, not a folder"
