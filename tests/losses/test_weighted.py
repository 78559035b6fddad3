"""WeightedLoss: the weighted sum, skipped terms and non-finite detection."""

from __future__ import annotations

import pytest
import torch
from loss_helpers import make_batch, make_output

from prvrlab.losses.base import Loss
from prvrlab.losses.weighted import LossResult, NonFiniteLossError, WeightedLoss
from prvrlab.registry import LOSSES, RegistryError


class Constant(Loss):
    """A term returning a fixed value and counting its calls."""

    def __init__(self, value: float) -> None:
        super().__init__()
        self.value = value
        self.calls = 0

    def forward(self, out, batch, *, epoch):
        self.calls += 1
        return torch.tensor(self.value, requires_grad=True)


def inputs():
    torch.manual_seed(0)
    sim = torch.rand(4, 3, requires_grad=True)
    logits = (sim * 5).detach().requires_grad_()
    vectors = torch.randn(4, 6, requires_grad=True)
    return make_output(sim, logits, vectors), make_batch([0, 0, 1, 2], 3)


CONFIG = {
    "clip_trip": {"loss": "triplet", "weight": 1.0, "margin": 0.2},
    "clip_nce": {"loss": "infonce", "weight": 0.04},
    "div": {"loss": "query_diverse", "weight": 0.5, "alpha": 8.0},
}


def test_total_is_the_weighted_sum_of_the_terms():
    out, batch = inputs()
    weighted = WeightedLoss.from_config(CONFIG)
    torch.manual_seed(3)
    result = weighted(out, batch, epoch=0)
    assert isinstance(result, LossResult)
    assert list(result.terms) == ["clip_trip", "clip_nce", "div"]
    torch.manual_seed(3)
    expected = {}
    for term, spec in CONFIG.items():
        params = {k: v for k, v in spec.items() if k not in ("loss", "weight")}
        expected[term] = LOSSES.build(spec["loss"], **params)(out, batch, epoch=0)
    for term, value in expected.items():
        assert result.terms[term].item() == pytest.approx(value.item())
        assert not result.terms[term].requires_grad
    total = sum(CONFIG[t]["weight"] * v.item() for t, v in expected.items())
    assert result.total.item() == pytest.approx(total)
    result.total.backward()
    assert out.scores["clip"].sim.grad is not None


def test_zero_weight_term_is_not_computed():
    a, b = Constant(2.0), Constant(float("nan"))
    weighted = WeightedLoss(losses={"a": a, "b": b}, weights={"a": 3.0, "b": 0.0})
    out, batch = inputs()
    result = weighted(out, batch, epoch=1)
    assert result.total.item() == 6.0
    assert list(result.terms) == ["a"]
    assert (a.calls, b.calls) == (1, 0)


def test_zero_weight_term_from_config_needs_nothing():
    # a weight-0 InfoNCE on a branch without logits must not be computed (nor fail)
    weighted = WeightedLoss.from_config(
        {"trip": {"loss": "triplet", "weight": 1.0}, "nce": {"loss": "infonce", "weight": 0.0}}
    )
    result = weighted(make_output(torch.rand(2, 2), None), make_batch([0, 1], 2), epoch=0)
    assert list(result.terms) == ["trip"]


def test_non_finite_term_is_flagged_and_named():
    weighted = WeightedLoss(
        losses={"fine": Constant(1.0), "broken": Constant(float("nan"))}, weights={"fine": 1.0, "broken": 0.1}
    )
    out, batch = inputs()
    result = weighted(out, batch, epoch=7)  # returned as is: the caller checks (no host sync per step)
    assert result.non_finite().tolist() == [1.0]
    with pytest.raises(NonFiniteLossError, match="broken") as info:
        result.check_finite(epoch=7)
    assert info.value.terms == ["broken"]
    assert "fine" not in str(info.value).split("term(s)")[1].split("(")[0]
    assert "epoch 8" in str(info.value)  # the loop's epoch 7 (from 0) is epoch 8 to users


@pytest.mark.parametrize("value", [float("inf"), float("-inf")])
def test_infinite_total_is_flagged_and_a_finite_one_is_not(value):
    out, batch = inputs()
    bad = WeightedLoss(losses={"a": Constant(1.0), "b": Constant(value)}, weights={"a": 1.0, "b": 1.0})(out, batch, epoch=0)
    assert bad.non_finite().tolist() == [1.0]
    with pytest.raises(NonFiniteLossError) as info:
        bad.check_finite(epoch=0)
    assert info.value.terms == ["b"]
    good = WeightedLoss(losses={"a": Constant(1.0)}, weights={"a": 2.0})(out, batch, epoch=0)
    assert good.non_finite().tolist() == [0.0]
    good.check_finite(epoch=0)


def test_invalid_construction():
    with pytest.raises(ValueError, match="weight of loss term 'a'"):
        WeightedLoss(losses={"a": Constant(1.0)}, weights={"a": -1.0})
    with pytest.raises(ValueError, match="every loss weight is 0"):
        WeightedLoss(losses={"a": Constant(1.0)}, weights={"a": 0.0})
    with pytest.raises(ValueError, match="same terms"):
        WeightedLoss(losses={"a": Constant(1.0)}, weights={"b": 1.0})
    with pytest.raises(RegistryError, match="did you mean 'triplet'"):
        WeightedLoss.from_config({"t": {"loss": "triplett", "weight": 1.0}})
    with pytest.raises(ValueError, match="margin"):
        WeightedLoss.from_config({"t": {"loss": "triplet", "weight": 1.0, "margin": -1.0}})


def test_loss_name_defaults_to_the_term():
    weighted = WeightedLoss.from_config({"triplet": {"weight": 2.0}})
    assert weighted.weights == {"triplet": 2.0}
    assert type(weighted.losses["triplet"]).__name__ == "TripletLoss"
