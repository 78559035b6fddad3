"""Resuming a search whose every trial has ended starts no Ray: the outcome is read from Tune's saved state,
the same as the first submission's; a study with a trial left to run still goes through Tune."""

from __future__ import annotations

import json

import pytest

from prvrlab.platform.search.spec import load_search_spec
from prvrlab.platform.search.tuning import ended_trials, search

from search_helpers import study_runs, tiny_spec

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def finished(tiny_root, tmp_path_factory):
    import ray

    tmp = tmp_path_factory.mktemp("finished_search")
    path = tiny_spec(tmp, tiny_root, name="ended", budget={"trials": 2}, overrides={"train.epochs": 1})
    try:
        first = search(load_search_spec(path), echo=None)
    finally:
        ray.shutdown()
    return tmp, path, first


def test_resuming_a_finished_search_starts_no_ray_and_gives_the_same_outcome(finished, capsys, monkeypatch):
    import ray

    from prvrlab.platform import runtime

    tmp, path, first = finished

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(runtime, "ensure_ray", no_ray)
    again = search(load_search_spec(path), resume=True, echo=print)
    out = capsys.readouterr().out
    assert not ray.is_initialized()  # nor did anything else start it
    assert "search 'ended': all 2 trials have ended; nothing left to resume" in out
    assert again.study_dir == first.study_dir and again.counts == first.counts == {
        "finished": 2, "early_stopped": 0, "failed": 0, "unfinished": 0}
    assert {k: again.best[k] for k in ("trial_id", "value", "config", "path")} == {
        k: first.best[k] for k in ("trial_id", "value", "config", "path")}
    parents, children = study_runs(tmp)
    (parent,) = parents
    assert len(children) == 2 and parent.info.status == "FINISHED" and parent.data.tags["prvrlab.status"] == "finished"
    assert parent.data.tags["prvrlab.best_trial"] == first.best["trial_id"]
    assert parent.data.metrics["best/val/sumr"] == pytest.approx(first.best["value"])


def test_a_study_with_a_trial_not_ended_or_fewer_trials_than_asked_is_left_to_tune(finished, tmp_path):
    import shutil

    _, _, first = finished
    assert [t.status for t in ended_trials(first.study_dir, 2)] == ["TERMINATED", "TERMINATED"]
    assert ended_trials(first.study_dir, 3) is None  # a trial the searcher has not created yet
    copy = tmp_path / "copy"
    shutil.copytree(first.study_dir, copy)
    assert ended_trials(copy, 2) is not None  # the copy reads as the study does
    (state,) = (copy / "tune").glob("experiment_state-*.json")
    saved = json.loads(state.read_text())
    entry = saved["trial_data"][0]
    trial = json.loads(entry[0])
    trial["status"] = "PAUSED"  # as a trial an interrupt stopped
    entry[0] = json.dumps(trial)
    state.write_text(json.dumps(saved))
    assert ended_trials(copy, 2) is None
    again = tmp_path / "again"
    shutil.copytree(first.study_dir, again)
    record = json.loads((again / "study.json").read_text())
    record["closed"].pop(next(iter(record["closed"])))  # a run the driver never closed (killed first)
    (again / "study.json").write_text(json.dumps(record))
    assert ended_trials(again, 2) is None
