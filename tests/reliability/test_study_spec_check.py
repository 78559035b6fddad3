"""Search specs that would fail after Ray starts are rejected by ``--check`` (issue 11, item 5)."""

from __future__ import annotations

import pytest

from prvrlab.platform.config import ConfigError
from prvrlab.platform.search.outcome import trial_outcome
from prvrlab.platform.search.spec import load_search_spec

from search_helpers import tiny_spec


@pytest.mark.parametrize(
    "space, message",
    [
        ({"train.epochs": {"uniform": [1, 3]}}, "integer"),
        ({"train.batch_size": {"loguniform": [8, 32]}}, "integer"),
        ({"model.num_heads": {"int": [2, 4]}}, "model.num_heads = 3"),
        ({"train.lr": {"uniform": [1e-4, 1e-3], "when": {"train.epochs": {">": "abc"}}}}, "number"),
        ({"train.lr": {"uniform": [1e-4, 1e-3], "when": {"train.epochs": {"in": 5}}}}, "list"),
        ({"train.lr": {"uniform": [1e-4, 1e-3], "when": {"train.epochs": {"not_in": "ab"}}}}, "list"),
    ],
)
def test_check_rejects_specs_that_fail_at_sampling(tmp_path, tiny_root, space, message):
    path = tiny_spec(tmp_path, tiny_root, space=space)
    with pytest.raises(ConfigError, match=message):
        load_search_spec(path)


def test_check_accepts_valid_int_and_float_keys(tmp_path, tiny_root):
    space = {
        "train.epochs": {"int": [1, 3]},
        "train.lr": {"loguniform": [1e-4, 1e-3], "when": {"train.epochs": {">=": 2}}},
        "model.num_heads": {"choice": [2, 4], "when": {"train.epochs": {"in": [2, 3]}}},
    }
    spec = load_search_spec(tiny_spec(tmp_path, tiny_root, space=space))
    assert [p.key for p in spec.space] == ["train.epochs", "train.lr", "model.num_heads"]


def test_invalid_sample_is_a_failed_outcome():
    assert trial_outcome({"kind": "invalid", "error": "bad"}) == "invalid"


@pytest.mark.slow
def test_invalid_sample_at_run_time_is_one_failed_trial(tmp_path, tiny_root):
    import dataclasses

    import ray

    from prvrlab.platform.search.spec import SearchParam
    from prvrlab.platform.search.tuning import search

    from search_helpers import study_runs

    spec = load_search_spec(tiny_spec(tmp_path, tiny_root, budget={"trials": 1}))
    spec = dataclasses.replace(spec, space=(SearchParam("model.num_heads", "choice", (3,)),))  # past --check
    try:
        result = search(spec, echo=None)
    finally:
        ray.shutdown()
    assert result.counts["failed"] == 1 and result.best is None
    (parent,), (child,) = study_runs(tmp_path)
    assert child.info.status == "FAILED" and "num_heads" in child.data.tags["error"]
    assert parent.info.status == "FAILED" and parent.data.tags["prvrlab.status"] == "failed"  # no trial finished
