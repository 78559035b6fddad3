"""A sampled config that does not validate ends its trial FAILED with the error, and its run still has the
sampled values as params, so the MLflow runs table and its parallel-coordinates plot show which values failed
(it had no params at all: a blank row)."""

from __future__ import annotations

import pytest

from prvrlab.platform.search.spec import load_search_spec
from prvrlab.platform.search.tuning import search

from search_helpers import study_runs, tiny_spec

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def ray_shutdown():
    yield
    import ray

    ray.shutdown()


def test_an_invalid_trial_keeps_its_sampled_values_as_params(tiny_root, tmp_path):
    path = tiny_spec(
        tmp_path, tiny_root, name="invalid", sampler={"type": "grid", "seed": 0}, budget={"trials": 4},
        space={"model.hidden_size": {"grid": [32, 36]}, "model.num_heads": {"grid": [2, 8]}}, overrides={"train.epochs": 1},
    )
    result = search(load_search_spec(path), echo=None)
    assert result.counts["finished"] == 3 and result.counts["failed"] == 1  # 36 is not divisible by 8 heads
    _, children = study_runs(tmp_path)
    (bad,) = [c for c in children if c.info.status == "FAILED"]
    assert "hidden_size" in bad.data.tags["error"]
    assert bad.data.params == {"model.hidden_size": "36", "model.num_heads": "8"}
    for good in (c for c in children if c.info.status == "FINISHED"):
        assert len(good.data.params) > 50  # the whole config
