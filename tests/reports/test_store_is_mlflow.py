"""report and compare only read: a tracking URI naming an SQLite file that is not an MLflow store (garbage, an
unrelated database, an empty file) is one error naming it, exit 2, and the file is left as it was (MLflow
would have created its tables inside it)."""

from __future__ import annotations

import sqlite3

import pytest

from prvrlab.platform.cli import EXIT_BAD_INPUT, main
from prvrlab.platform.tracking.store import Tracker
from prvrlab.reports.errors import ReportError
from prvrlab.reports.source import mlflow_client


def _tables(path) -> set[str]:
    with sqlite3.connect(path) as db:
        return {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


@pytest.fixture
def stores(tmp_path):
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(bytes(range(256)) * 20)
    other = tmp_path / "other.db"
    with sqlite3.connect(other) as db:
        db.execute("CREATE TABLE runs (x)")
    empty = tmp_path / "empty.db"
    empty.write_bytes(b"")
    return {"garbage": garbage, "other": other, "empty": empty}


@pytest.mark.parametrize("name, why", [
    ("garbage", "cannot be read as an SQLite database (file is not a database)"),
    ("other", "is not an MLflow store (it lacks MLflow's tables experiments, metrics, params, tags)"),
    ("empty", "is empty"),
])
def test_a_file_that_is_no_mlflow_store_is_refused_and_left_alone(stores, capsys, name, why):
    path = stores[name]
    before = path.read_bytes()
    uri = f"sqlite:///{path}"
    with pytest.raises(ReportError) as caught:
        mlflow_client(uri, existing=True)
    assert str(caught.value) == f"tracking store {uri}: the database file {path} {why}"
    for command in (["compare", "a" * 32, "b" * 32], ["report", "--experiment", "x"]):
        assert main([*command, "--tracking-uri", uri]) == EXIT_BAD_INPUT
        assert capsys.readouterr().err.strip() == f"prvrlab: error: tracking store {uri}: the database file {path} {why}"
    assert path.read_bytes() == before


def test_an_mlflow_store_opens(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run = Tracker(uri, "tests").start_run("r", tags={})
    assert mlflow_client(uri, existing=True).get_run(run).info.run_id == run
    assert {"experiments", "runs"} <= _tables(tmp_path / "mlflow.db")
