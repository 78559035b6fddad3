"""New SQLite stores are copies of an empty, migrated one (prvrlab.platform.tracking.template)."""

from __future__ import annotations

import os
import sqlite3
import threading
from pathlib import Path

import pytest

from prvrlab.platform.tracking import template
from prvrlab.platform.tracking.store import Tracker


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("PRVRLAB_CACHE_DIR", str(folder))
    return folder


def _schema(path: Path) -> set[tuple]:
    """Every table, index and trigger with its definition's lines as a set: MLflow's own migrations order
    a table's named constraints by string hashing, so two stores it builds differ in that order."""
    con = sqlite3.connect(path)
    try:
        rows = con.execute("SELECT type, name, tbl_name, sql FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'")
        return {(*row[:3], frozenset(line.strip().rstrip(",") for line in (row[3] or "").splitlines())) for row in rows}
    finally:
        con.close()


def _rows(path: Path, sql: str) -> list[tuple]:
    con = sqlite3.connect(path)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def _plant_experiment(path: Path) -> None:
    con = sqlite3.connect(path)
    with con:
        con.execute(
            "INSERT INTO experiments (experiment_id, name, artifact_location, lifecycle_stage, workspace) "
            "VALUES (7, 'planted', '/x', 'active', 'default')"
        )
    con.close()


def test_a_seeded_store_is_the_store_mlflow_builds(cache, tmp_path, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.chdir(tmp_path)
    plain, seeded = tmp_path / "plain" / "mlflow.db", tmp_path / "seeded" / "mlflow.db"
    plain.parent.mkdir()
    seeded.parent.mkdir()
    MlflowClient(tracking_uri=f"sqlite:///{plain}").search_experiments()  # MLflow's own creation
    assert template.seed(f"sqlite:///{seeded}") is True
    assert template.template_path().is_file()
    assert _schema(seeded) == _schema(plain)
    assert _rows(seeded, "SELECT * FROM alembic_version") == _rows(plain, "SELECT * FROM alembic_version")
    assert _rows(seeded, "SELECT * FROM experiments") == []  # MLflow adds experiment 0 when it opens it
    assert _rows(seeded, "SELECT * FROM workspaces") == _rows(plain, "SELECT * FROM workspaces")

    tracker = Tracker(f"sqlite:///{seeded}", "exp")
    default = tracker.client.get_experiment("0")
    theirs = MlflowClient(tracking_uri=f"sqlite:///{plain}").get_experiment("0")
    assert (default.name, default.artifact_location) == (theirs.name, theirs.artifact_location)
    assert tracker.experiment_id == "1"
    run = tracker.start_run("r")
    tracker.log_metrics(run, {"m": 1.5}, step=0)
    tracker.end_run(run, "FINISHED")
    got = tracker.client.get_run(run)
    assert got.info.status == "FINISHED" and got.data.metrics == {"m": 1.5}


def test_an_existing_store_is_never_replaced(cache, tmp_path):
    store = tmp_path / "mlflow.db"
    store.write_bytes(b"mine")
    assert template.seed(f"sqlite:///{store}") is False
    assert store.read_bytes() == b"mine"


def test_a_store_made_meanwhile_is_kept_and_nothing_is_left_behind(cache, tmp_path, monkeypatch):
    store = tmp_path / "mlflow.db"
    real_link = os.link

    def racing_link(src, dst):
        Path(dst).write_bytes(b"theirs")  # another process created the store first
        real_link(src, dst)

    monkeypatch.setattr(template.os, "link", racing_link)
    assert template.seed(f"sqlite:///{store}") is False
    assert store.read_bytes() == b"theirs"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "mlflow.db"]


def test_concurrent_seeds_create_the_store_once(cache, tmp_path):
    template.seed(f"sqlite:///{tmp_path / 'warm.db'}")  # the template exists: the threads race on the store
    store = tmp_path / "mlflow.db"
    results, go = [], threading.Barrier(4)

    def one():
        go.wait()
        results.append(template.seed(f"sqlite:///{store}"))

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False, False, False, True]
    assert _rows(store, "SELECT count(*) FROM alembic_version") == [(1,)]
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".seed")]


def test_the_new_store_gets_the_umask_mode(cache, tmp_path):
    old = os.umask(0o027)
    try:
        assert template.seed(f"sqlite:///{tmp_path / 'mlflow.db'}") is True
    finally:
        os.umask(old)
    assert (tmp_path / "mlflow.db").stat().st_mode & 0o777 == 0o640


def test_a_template_others_may_write_is_made_again(cache, tmp_path):
    template.seed(f"sqlite:///{tmp_path / 'first.db'}")
    path = template.template_path()
    os.chmod(path, 0o666)
    _plant_experiment(path)
    assert template.seed(f"sqlite:///{tmp_path / 'second.db'}") is True
    assert path.stat().st_mode & 0o777 == 0o600
    assert _rows(tmp_path / "second.db", "SELECT count(*) FROM experiments") == [(0,)]


def test_a_template_that_is_not_empty_is_made_again(cache, tmp_path):
    template.seed(f"sqlite:///{tmp_path / 'first.db'}")
    _plant_experiment(template.template_path())
    assert template.seed(f"sqlite:///{tmp_path / 'second.db'}") is True
    assert _rows(tmp_path / "second.db", "SELECT name FROM experiments") == []
    assert _rows(template.template_path(), "SELECT count(*) FROM experiments") == [(0,)]


def test_a_cache_folder_others_may_write_is_not_used(cache, tmp_path):
    folder = template.template_path().parent
    folder.mkdir(parents=True)
    folder.chmod(0o777)
    store = tmp_path / "mlflow.db"
    assert template.seed(f"sqlite:///{store}") is False
    assert not store.exists() and not any(folder.iterdir())
    tracker = Tracker(f"sqlite:///{store}", "exp")  # MLflow creates the store itself
    assert tracker.client.get_experiment("0").name == "Default"


def test_other_uris_are_left_to_mlflow(cache, tmp_path):
    assert template.seed("http://127.0.0.1:5000") is False
    assert template.seed(f"file://{tmp_path}/mlruns") is False
    assert template.seed(f"sqlite:///{tmp_path / 'mlflow.db'}?timeout=20") is False
    assert list(tmp_path.iterdir()) == []
    assert not cache.exists()


def test_a_tracker_on_a_new_store_seeds_it(cache, tmp_path, monkeypatch):
    seeded = []
    real = template.seed
    monkeypatch.setattr(template, "seed", lambda uri: seeded.append(real(uri)) or seeded[-1])
    Tracker(f"sqlite:///{tmp_path / 'a' / 'mlflow.db'}", "exp")
    Tracker(f"sqlite:///{tmp_path / 'a' / 'mlflow.db'}", "exp")
    assert seeded == [True, False]


def test_building_removes_other_versions_and_stale_builds(cache, tmp_path):
    folder = template.template_path().parent
    folder.mkdir(parents=True, mode=0o700)
    other = folder / "mlflow-0.0.1.db"
    other.write_bytes(b"old")
    stale, fresh = folder / ".build-stale", folder / ".build-fresh"
    stale.mkdir()
    fresh.mkdir()
    hours_ago = os.stat(stale).st_mtime - 7200
    os.utime(stale, (hours_ago, hours_ago))
    assert template.seed(f"sqlite:///{tmp_path / 'mlflow.db'}") is True
    assert sorted(p.name for p in folder.iterdir()) == [".build-fresh", template.template_path().name]


def test_a_template_that_cannot_be_built_leaves_the_store_to_mlflow(cache, tmp_path, monkeypatch):
    def broken():
        raise RuntimeError("migration failed")

    monkeypatch.setattr(template, "_build_template", broken)
    store = tmp_path / "mlflow.db"
    assert template.seed(f"sqlite:///{store}") is False
    assert not store.exists()
    tracker = Tracker(f"sqlite:///{store}", "exp")
    assert tracker.client.get_experiment("0").name == "Default"


def test_a_damaged_template_is_made_again(cache, tmp_path):
    template.seed(f"sqlite:///{tmp_path / 'first.db'}")
    path = template.template_path()
    data = bytearray(path.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 4096] = b"\xff" * 4096  # a page in the middle overwritten
    path.write_bytes(bytes(data))
    assert template._usable_template() is None
    assert template.seed(f"sqlite:///{tmp_path / 'second.db'}") is True
    assert template._usable_template() == path
    assert _rows(tmp_path / "second.db", "PRAGMA integrity_check") == [("ok",)]
