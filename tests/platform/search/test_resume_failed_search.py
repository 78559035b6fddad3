"""Resuming a search whose only trial failed starts no Ray either: a resume does not retry a failed trial, so
the outcome is the first submission's (no best trial, the parent run FAILED), read from Tune's saved state."""

from __future__ import annotations

import pytest

from prvrlab.platform.search.spec import load_search_spec
from prvrlab.platform.search.tuning import ended_trials, search

from search_helpers import study_runs, tiny_spec

pytestmark = pytest.mark.slow


def test_resuming_a_search_whose_trials_all_failed_starts_no_ray_and_records_the_failure(tiny_root, tmp_path, monkeypatch, capsys):
    import ray

    from prvrlab.platform import runtime

    monkeypatch.setenv("PRVRLAB_FAULT_EPOCH", "0")
    monkeypatch.setenv("PRVRLAB_FAULT_MARKER", str(tmp_path / "raised"))
    monkeypatch.setenv("PRVRLAB_FAULT_KIND", "raise")  # an error in the training code: failed, not retried
    path = tiny_spec(tmp_path, tiny_root, name="allfailed", budget={"trials": 1}, overrides={"train.epochs": 1})
    try:
        first = search(load_search_spec(path), echo=None)
    finally:
        ray.shutdown()
    assert first.counts["failed"] == 1 and first.best is None, first.counts
    assert len(ended_trials(first.study_dir, 1)) == 1  # Tune ended it; the driver closed its run FAILED

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(runtime, "ensure_ray", no_ray)
    again = search(load_search_spec(path), resume=True, echo=print)
    assert not ray.is_initialized()
    assert "search 'allfailed': all 1 trials have ended; nothing left to resume" in capsys.readouterr().out
    assert again.study_dir == first.study_dir and again.best is None and again.counts == first.counts
    assert not (first.study_dir / "best_config.yaml").exists()
    parents, children = study_runs(tmp_path)
    (parent,) = parents
    (child,) = children
    assert child.info.status == "FAILED" and parent.info.status == "FAILED"
    assert parent.data.metrics["trials/failed"] == 1 and "prvrlab.best_trial" not in parent.data.tags
