"""MLflow's own provenance tags on every run (the UI's User, Source and Version columns) and a study's
description from its spec's header comment (the run page's Description)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from prvrlab.platform.search.outcome import RunMap
from prvrlab.platform.search.spec import load_search_spec
from prvrlab.platform.search.study import header_comment, open_parent
from prvrlab.platform.tracking import store
from prvrlab.platform.tracking.store import Tracker

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from search_helpers import tiny_spec  # noqa: E402


@pytest.fixture
def command(monkeypatch):
    argv = ["/opt/venv/bin/prvrlab", "train", "configs/x.yaml", "--set", "tracking.uri=http://ann:s3cret@host:5000", "--set", "train.lr=1e-3"]
    monkeypatch.setattr(sys, "argv", argv)
    store.source_tags.cache_clear()
    yield argv
    store.source_tags.cache_clear()


def test_every_run_says_who_ran_which_command_at_which_commit(tmp_path, command):
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "source")
    run_id = tracker.start_run("r", tags={"git_commit": "0123abcd-dirty"})
    tags = tracker.client.get_run(run_id).data.tags
    tracker.client.set_terminated(run_id)
    assert tags["mlflow.source.name"] == "prvrlab train configs/x.yaml --set tracking.uri=http://ann:***@host:5000 --set train.lr=1e-3"
    assert tags["mlflow.source.type"] == "LOCAL" and tags["mlflow.user"]
    assert tags["mlflow.source.git.commit"] == "0123abcd" and tags["git_commit"] == "0123abcd-dirty"
    unknown = tracker.start_run("u", tags={"git_commit": "unknown"})
    assert "mlflow.source.git.commit" not in tracker.client.get_run(unknown).data.tags
    tracker.client.set_terminated(unknown)


def test_header_comment(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("# First line.\n#   indented\n#\nname: x\n# not the header\n")
    assert header_comment(path) == "First line.\n  indented"
    path.write_text("name: x\n# later\n")
    assert header_comment(path) == ""


def test_a_study_parent_is_described_by_its_spec_header(tiny_root, tmp_path):
    path = tiny_spec(tmp_path, tiny_root, name="described")
    path.write_text("# A tiny search over the learning rate.\n# Second line.\n" + path.read_text())
    spec = load_search_spec(path)
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "tests")
    study_dir = tmp_path / "study"
    study_dir.mkdir()
    run_id = open_parent(tracker, RunMap(study_dir), spec, "search", study_dir)
    tags = tracker.client.get_run(run_id).data.tags
    tracker.client.set_terminated(run_id)
    assert tags["mlflow.note.content"] == "A tiny search over the learning rate.\nSecond line."
