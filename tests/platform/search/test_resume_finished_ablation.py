"""Resuming an ablation whose every cell has finished starts no Ray: it says so and sums up as a resubmission does."""

from __future__ import annotations

import pytest

from prvrlab.platform.search.ablation import ablate
from prvrlab.platform.search.spec import load_ablation_spec

from search_helpers import study_runs, tiny_spec

pytestmark = pytest.mark.slow


def test_resuming_a_finished_ablation_starts_no_ray(tiny_root, tmp_path, capsys, monkeypatch):
    import ray

    from prvrlab.platform import runtime

    path = tiny_spec(tmp_path, tiny_root, name="done", variants={"full": {}}, seeds=[0])
    try:
        first = ablate(load_ablation_spec(path), echo=print)
    finally:
        ray.shutdown()
    assert first.counts == {"finished": 1, "failed": 0, "missing": 0}
    capsys.readouterr()

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(runtime, "ensure_ray", no_ray)
    again = ablate(load_ablation_spec(path), resume=True, echo=print)
    out = capsys.readouterr().out
    assert again.counts == first.counts and not again.interrupted
    assert "ablation 'done': every cell has finished; nothing left to resume" in out
    assert again.study_dir == first.study_dir  # the resumed submission, not a new stamped folder
    parents, children = study_runs(tmp_path)
    assert len(parents) == 1 and parents[0].info.status == "FINISHED" and len(children) == 1
    assert parents[0].data.tags["prvrlab.status"] == "finished"
