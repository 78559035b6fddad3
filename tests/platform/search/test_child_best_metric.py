"""Every finished trial's run carries ``best/<metric>`` under the parent's key: the value the search ranked it by
(the metric's best over its reports), so one column of the MLflow runs table sorts the trials as the study did,
whatever the metric (with ``val/r1`` the children's ``best/sumr`` and ``final/*`` follow the SumR-best epoch)."""

from __future__ import annotations

import pytest

from prvrlab.platform.search.spec import load_search_spec
from prvrlab.platform.search.tuning import search

from search_helpers import metric_history, study_runs, tiny_spec

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def ray_shutdown():
    yield
    import ray

    ray.shutdown()


def test_children_carry_the_search_metric_best_under_the_parent_key(tiny_root, tmp_path):
    spec = load_search_spec(tiny_spec(tmp_path, tiny_root, name="r1", metric="val/r1", mode="max", budget={"trials": 2}))
    result = search(spec, echo=None)
    assert result.counts["finished"] == 2
    (parent,), children = study_runs(tmp_path)
    best = {}
    for child in children:
        history = [m.value for m in metric_history(tmp_path, child.info.run_id, "val/r1")]
        assert len(history) == 2  # both epochs reported
        assert child.data.metrics["best/val/r1"] == pytest.approx(max(history))
        best[child.info.run_id] = child.data.metrics["best/val/r1"]
    assert parent.data.metrics["best/val/r1"] == pytest.approx(max(best.values()))
    assert best[parent.data.tags["prvrlab.best_run"]] == pytest.approx(max(best.values()))
