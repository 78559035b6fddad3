"""A killed ablation's RUNNING child runs are closed KILLED on resubmission (issue 11, item 4)."""

from __future__ import annotations

import pytest

from prvrlab.platform.search.ablation import ablate
from prvrlab.platform.search.spec import load_ablation_spec
from prvrlab.platform.tracking.store import Tracker

from search_helpers import study_runs, tiny_spec


@pytest.mark.slow
def test_resubmission_closes_orphans_and_reruns_their_cell_once(tmp_path, tiny_root):
    import ray

    path = tiny_spec(tmp_path, tiny_root, name="orph", variants={"full": {}}, seeds=[0])
    spec = load_ablation_spec(path)
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "tests")
    parent = tracker.start_run("orph-killed", tags={"prvrlab.kind": "ablation", "prvrlab.study": "orph"})
    tags = {"prvrlab.kind": "trial", "prvrlab.study": "orph", "prvrlab.study_kind": "ablation", "prvrlab.cell": "full/seed0"}
    orphans = [tracker.start_run("orph/full/seed0", tags=tags, parent_run_id=parent) for _ in range(2)]
    try:
        result = ablate(spec, echo=None)
    finally:
        ray.shutdown()
    assert result.counts == {"finished": 1, "failed": 0, "missing": 0}
    _, children = study_runs(tmp_path)
    assert not [c for c in children if c.info.status == "RUNNING"]
    finished = [c for c in children if c.info.status == "FINISHED"]
    assert [c.data.tags["prvrlab.cell"] for c in finished] == ["full/seed0"]
    for run_id in orphans:
        run = tracker.client.get_run(run_id)
        assert run.info.status == "KILLED" and run.data.tags["prvrlab.status"] == "killed"
