"""A study's parent reopened by a later submission (a resumed search, an ablation submitted again) takes
that submission's code and command tags; the first submission's commit stays in ``prvrlab.first_git_commit``."""

from __future__ import annotations

import sys

import mlflow
import pytest

from prvrlab.platform.search.outcome import RunMap
from prvrlab.platform.search.spec import load_ablation_spec
from prvrlab.platform.search.study import FIRST_COMMIT_TAG, open_parent
from prvrlab.platform.tracking import store
from prvrlab.platform.tracking.store import VERSION_TAG, Tracker

from search_helpers import tiny_spec


@pytest.fixture
def submit(tiny_root, tmp_path, monkeypatch):
    """Open (or reopen) the ablation's parent as a submission at ``commit`` with command ``argv``; returns its tags."""
    spec = load_ablation_spec(tiny_spec(tmp_path, tiny_root, name="prov", variants={"full": {}}, seeds=[0]))
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "tests")
    folder = tmp_path / "study"
    folder.mkdir()

    def submission(commit: str, argv: list[str]) -> dict[str, str]:
        monkeypatch.setattr(store, "git_commit", lambda: commit)
        monkeypatch.setattr(sys, "argv", argv)
        store.source_tags.cache_clear()  # read once per process: each submission is its own process
        run_id = open_parent(tracker, RunMap(folder), spec, "ablation", folder)
        tracker.end_run(run_id, "FINISHED")
        return mlflow.MlflowClient(tracker.uri).get_run(run_id).data.tags

    return submission


def test_a_later_submission_s_commit_and_command_replace_the_first(submit):
    first = submit("a" * 40, ["prvrlab", "ablate", "prov.yaml"])
    assert first["git_commit"] == "a" * 40 and first[VERSION_TAG] == "a" * 40 and FIRST_COMMIT_TAG not in first
    second = submit("b" * 40 + "-dirty", ["prvrlab", "ablate", "prov.yaml", "--set", "train.lr=1e-3"])
    assert second["git_commit"] == "b" * 40 + "-dirty" and second["prvrlab.git_dirty"] == "true"
    assert second[VERSION_TAG] == "b" * 40
    assert second["mlflow.source.name"] == "prvrlab ablate prov.yaml --set train.lr=1e-3"
    assert second[FIRST_COMMIT_TAG] == "a" * 40
    third = submit("c" * 40, ["prvrlab", "ablate", "prov.yaml"])
    assert third[FIRST_COMMIT_TAG] == "a" * 40 and third["git_commit"] == "c" * 40  # still the very first


def test_the_same_code_leaves_no_first_commit_tag_and_an_unknown_one_no_stale_version(submit):
    submit("a" * 40, ["prvrlab", "ablate", "prov.yaml"])
    again = submit("a" * 40, ["prvrlab", "ablate", "prov.yaml"])
    assert FIRST_COMMIT_TAG not in again and again[VERSION_TAG] == "a" * 40
    unknown = submit("unknown", ["prvrlab", "ablate", "prov.yaml"])
    assert unknown["git_commit"] == "unknown" and VERSION_TAG not in unknown
    assert unknown[FIRST_COMMIT_TAG] == "a" * 40
