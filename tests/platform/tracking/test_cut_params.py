"""MLflow keeps 6,000 characters of a param: a longer value is cut and the run's ``prvrlab.cut_params``
tag names it; a study spec whose parent-run params the report reads back whole (``space.*``,
``variant.*``, ``spec.overrides``) is refused when one of them would be cut."""

from __future__ import annotations

import mlflow
import pytest

from prvrlab.platform.config import ConfigError
from prvrlab.platform.search.spec import load_ablation_spec, load_search_spec
from prvrlab.platform.tracking.store import CUT_PARAMS_TAG, PARAM_MAX, Tracker

from search_helpers import tiny_spec


def test_cut_params_are_named_on_the_run(tmp_path):
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "cut")
    run_id = tracker.start_run("r")
    tracker.log_params(run_id, {"a.long": "x" * (PARAM_MAX + 1), "a.fits": "y" * PARAM_MAX, "a.short": 1})
    run = mlflow.MlflowClient(tracker.uri).get_run(run_id)
    assert run.data.params["a.long"] == "x" * (PARAM_MAX - 3) + "..."
    assert run.data.params["a.fits"] == "y" * PARAM_MAX  # exactly the limit: kept whole, not named
    assert run.data.tags[CUT_PARAMS_TAG] == "a.long"
    tracker.log_params(run_id, {"b.long": ["z"] * PARAM_MAX})
    assert mlflow.MlflowClient(tracker.uri).get_run(run_id).data.tags[CUT_PARAMS_TAG] == "a.long,b.long"


def test_whole_params_leave_no_tag(tmp_path):
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "cut")
    run_id = tracker.start_run("r")
    tracker.log_params(run_id, {"a": "x" * PARAM_MAX})
    assert CUT_PARAMS_TAG not in mlflow.MlflowClient(tracker.uri).get_run(run_id).data.tags


def _count(n: int) -> list[float]:
    """A list whose text is about ``n`` characters (each item '0.001, ' is 7)."""
    return [0.001] * (n // 7 + 1)


def test_a_space_entry_mlflow_would_cut_is_refused(tiny_root, tmp_path):
    long = tiny_spec(tmp_path, tiny_root, name="long", space={"train.lr": {"choice": _count(PARAM_MAX)}})
    with pytest.raises(ConfigError, match=r"space\.train\.lr: its text \([\d,]+ characters\) exceeds MLflow's 6,000"):
        load_search_spec(long)
    fits = tiny_spec(tmp_path, tiny_root, name="fits", space={"train.lr": {"choice": _count(PARAM_MAX // 2)}})
    assert load_search_spec(fits).space[0].key == "train.lr"


def test_a_variant_or_overrides_mlflow_would_cut_is_refused(tiny_root, tmp_path):
    variant = tiny_spec(tmp_path, tiny_root, name="variant", variants={"big": {"train.lr": _count(PARAM_MAX)}}, seeds=[0])
    with pytest.raises(ConfigError, match=r"variants\.big: its text .* param 'variant\.big'"):
        load_ablation_spec(variant)
    overrides = tiny_spec(tmp_path, tiny_root, name="over", variants={"full": {}}, seeds=[0],
                          overrides={"tracking.experiment": "e" * PARAM_MAX})
    with pytest.raises(ConfigError, match=r"overrides: its text .* param 'spec\.overrides'"):
        load_ablation_spec(overrides)
