"""The seam's distributions: a component's log_distribution and the artifact record the loop writes."""

from __future__ import annotations

import math

import pytest
import torch

from prvrlab.models.component import Component, histogram_record


def test_histogram_record_bins_clamps_and_sums_over_ranks():
    values = torch.tensor([-1.0, -0.5, 0.2, 0.2, 3.0])
    record = histogram_record({"x": values, "empty": torch.zeros(0)}, low=-1.0, high=1.0, bins=4)
    assert record["edges"] == [-1.0, -0.5, 0.0, 0.5, 1.0]
    x = record["series"]["x"]
    assert x["counts"] == [1, 1, 2, 1]  # 3.0 is counted in the last bin; its own value in the mean
    mean = sum(values.tolist()) / 5
    assert x["n"] == 5 and x["mean"] == pytest.approx(mean)
    assert x["std"] == pytest.approx(math.sqrt(sum((v - mean) ** 2 for v in values.tolist()) / 5))
    empty = record["series"]["empty"]
    assert empty["counts"] == [0, 0, 0, 0] and empty["n"] == 0 and math.isnan(empty["mean"])

    def two_ranks(t, op="sum"):  # both ranks hold the same values
        return 2 * t

    doubled = histogram_record({"x": values}, low=-1.0, high=1.0, bins=4, all_reduce=two_ranks)["series"]["x"]
    assert doubled["counts"] == [2, 2, 4, 2] and doubled["n"] == 10
    assert doubled["mean"] == pytest.approx(x["mean"]) and doubled["std"] == pytest.approx(x["std"])


def test_log_distribution_is_popped_once_and_checks_its_range():
    component = Component()
    component.log_distribution("d", {"a": torch.ones(2)}, low=0.0, high=2.0, bins=2)
    (name, (series, low, high, bins)), = component.pop_distributions().items()
    assert (name, low, high, bins) == ("d", 0.0, 2.0, 2) and series["a"].tolist() == [1.0, 1.0]
    assert component.pop_distributions() == {}
    with pytest.raises(ValueError, match="'d'"):
        component.log_distribution("d", {}, low=1.0, high=1.0)
