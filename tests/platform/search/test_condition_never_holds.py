"""A ``when`` condition on a searched key that no value of that key meets is refused (its key would never
be sampled), as one on a key that is not searched already was: an order test on a ``choice``, a value
outside an ``int`` range, a bound past a continuous range, every choice excluded."""

from __future__ import annotations

import pytest

from prvrlab.platform.config import ConfigError
from prvrlab.platform.search.spec import load_search_spec

from search_helpers import tiny_spec

DELTA = {"uniform": [0.1, 0.3]}


def _space(condition_key, distribution, expected):
    return {condition_key: distribution, "losses.query_diverse.delta": {**DELTA, "when": {condition_key: expected}}}


WEIGHT = ("losses.query_diverse.weight", {"choice": [0.0, 0.003]})
BLOCKS = ("model.num_gmm_blocks", {"int": [1, 3]})
LR = ("train.lr", {"uniform": [0.001, 0.002]})


@pytest.mark.parametrize(
    "searched, expected",
    [
        (WEIGHT, {">": 5}),
        (WEIGHT, {"<": 0.0}),
        (WEIGHT, {"not_in": [0.0, 0.003]}),
        (BLOCKS, 7),
        (BLOCKS, {">=": 4}),
        (BLOCKS, {"in": [0, 4]}),
        (LR, {">": 0.5}),
        (LR, {"<=": 0.0005}),
    ],
)
def test_a_condition_no_searched_value_meets_is_refused(tiny_root, tmp_path, searched, expected):
    key, distribution = searched
    path = tiny_spec(tmp_path, tiny_root, space=_space(key, distribution, expected))
    with pytest.raises(ConfigError, match=rf"when\.{key}: never holds: '{key}' is searched over .* would never be sampled"):
        load_search_spec(path)


@pytest.mark.parametrize(
    "searched, expected",
    [
        (WEIGHT, {">": 0}),
        (WEIGHT, {"not_in": [0.0]}),
        (BLOCKS, 3),
        (BLOCKS, {">": 2}),
        (BLOCKS, {"not_in": [1, 3]}),  # 2 is left: the ends alone would not show it
        (LR, {">": 0.0019}),
        (LR, {"<": 0.0011}),
    ],
)
def test_a_condition_some_value_meets_passes(tiny_root, tmp_path, searched, expected):
    key, distribution = searched
    spec = load_search_spec(tiny_spec(tmp_path, tiny_root, space=_space(key, distribution, expected)))
    assert spec.space[1].when == {key: expected}


def test_a_conditional_key_may_also_meet_it_with_its_unsampled_value(tiny_root, tmp_path):
    # blocks is sampled only when lr > 0.0015; elsewhere it keeps the base config's value, which delta's test can meet
    space = {
        "train.lr": {"uniform": [0.001, 0.002]},
        "model.num_gmm_blocks": {"int": [5, 6], "when": {"train.lr": {">": 0.0015}}},
        "losses.query_diverse.delta": {**DELTA, "when": {"model.num_gmm_blocks": {"<": 5}}},
    }
    base_blocks = load_search_spec(tiny_spec(tmp_path, tiny_root, name="probe", space={"train.lr": LR[1]})).base.model.get("num_gmm_blocks")
    if base_blocks is None or not base_blocks < 5:
        pytest.skip("the base config's num_gmm_blocks is not below 5")
    assert len(load_search_spec(tiny_spec(tmp_path, tiny_root, space=space)).space) == 3
