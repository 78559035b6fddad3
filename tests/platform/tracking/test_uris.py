"""Local store URIs: one parser, and a query string (SQLAlchemy's connection arguments) is not part of the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from prvrlab.platform.config import ConfigError
from prvrlab.platform.tracking import closer
from prvrlab.platform.tracking.store import Tracker
from prvrlab.platform.tracking.uri import resolve_tracking_uri
from prvrlab.platform.tracking.template import store_path
from prvrlab.uris import file_store, sqlite_file


def test_the_file_of_an_sqlite_uri_leaves_its_query_out():
    assert sqlite_file("sqlite:////data/runs/mlflow.db") == Path("/data/runs/mlflow.db")
    assert sqlite_file("sqlite:////data/runs/mlflow.db?timeout=30&uri=true") == Path("/data/runs/mlflow.db")
    assert sqlite_file("sqlite:///mlflow.db") == Path("mlflow.db")
    assert sqlite_file("http://127.0.0.1:5000") is None and sqlite_file("file:///data/mlruns") is None
    assert store_path("sqlite:////data/runs/mlflow.db?timeout=30") is None  # the template leaves these to MLflow
    assert store_path("sqlite:////data/runs/mlflow.db") == Path("/data/runs/mlflow.db")


def test_the_folder_of_a_file_uri_with_or_without_its_slashes():
    assert file_store("file:///data/mlruns") == Path("/data/mlruns") == file_store("file:/data/mlruns")
    assert file_store("sqlite:////data/mlflow.db") is None


def test_relative_store_paths_become_absolute_and_keep_their_query(tmp_path):
    assert resolve_tracking_uri("sqlite:///runs/mlflow.db?timeout=30", cwd=tmp_path) == (
        f"sqlite:///{tmp_path.resolve() / 'runs' / 'mlflow.db'}?timeout=30"
    )
    assert resolve_tracking_uri("file:mlruns", cwd=tmp_path) == f"file://{tmp_path.resolve() / 'mlruns'}"
    assert resolve_tracking_uri("file:///abs/mlruns", cwd=tmp_path) == "file:///abs/mlruns"


def test_a_store_named_with_a_query_string_still_has_its_runs_closed(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}?timeout=30"
    tracker = Tracker(uri, "query")
    run_id = tracker.start_run("stopped")

    assert closer.close_runs({run_id: uri}, "stopped by a test") == [run_id]
    run = tracker.client.get_run(run_id)
    assert run.info.status == "KILLED" and run.data.tags["prvrlab.stop_reason"] == "stopped by a test"
    assert [p.name for p in tmp_path.iterdir()] == ["mlflow.db"]  # no file named after the query
    tracker.end_run(run_id, "KILLED")


def test_a_folder_named_as_the_store_is_refused_whatever_its_query(tmp_path):
    (tmp_path / "mlflow.db").mkdir()
    with pytest.raises(ConfigError, match="the path is a folder"):
        Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}?timeout=5", "folder")

