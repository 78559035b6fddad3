"""A study's parent run says how it ended: FAILED when no trial or cell finished, FINISHED tagged
``prvrlab.status=partial`` when some failed, ``finished`` when none did, KILLED when interrupted."""

from __future__ import annotations

import pytest

from prvrlab.platform.cli import EXIT_FAILED, main
from prvrlab.platform.search.study import parent_status

from search_helpers import study_runs, tiny_spec


class Tags:
    """The part of a Tracker parent_status uses."""

    def __init__(self) -> None:
        self.tags: dict[str, str] = {}

    def set_tags(self, run_id: str, tags: dict[str, str]) -> None:
        self.tags.update(tags)


@pytest.mark.parametrize(
    ("interrupted", "ok", "complete", "status", "tag"),
    [
        (False, False, False, "FAILED", "failed"),
        (False, True, False, "FINISHED", "partial"),
        (False, True, True, "FINISHED", "finished"),
        (True, False, False, "KILLED", None),
        (True, True, True, "KILLED", None),
    ],
)
def test_parent_status(interrupted, ok, complete, status, tag):
    tracker = Tags()
    assert parent_status(tracker, "p", interrupted=interrupted, ok=ok, complete=complete) == status
    assert tracker.tags.get("prvrlab.status") == tag


@pytest.fixture
def ray_down():
    yield
    import ray

    ray.shutdown()


@pytest.mark.slow
def test_ablation_with_a_failed_cell_exits_1_and_its_parent_is_partial(tiny_root, tmp_path, ray_down):
    variants = {"ok": {}, "nan": {"train.lr": 1.0e7, "train.grad_clip": 0.0}}
    path = tiny_spec(tmp_path, tiny_root, name="part", variants=variants, baseline="ok", seeds=[0])
    assert main(["ablate", str(path)]) == EXIT_FAILED
    (parent,), children = study_runs(tmp_path)
    statuses = sorted(c.data.tags["prvrlab.status"] for c in children)
    assert statuses == ["finished", "nonfinite"], statuses
    assert parent.info.status == "FINISHED" and parent.data.tags["prvrlab.status"] == "partial"
    assert parent.data.metrics["cells/finished"] == 1 and parent.data.metrics["cells/failed"] == 1
