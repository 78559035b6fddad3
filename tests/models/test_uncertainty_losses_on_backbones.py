"""GMMFormer v2's plug-in losses (optimal matching, revamped query-diverse) on every registered backbone."""

from __future__ import annotations

import pytest
import torch
from test_backbones import NAMES, build, make_batch, standard_batch

from prvrlab.losses.weighted import WeightedLoss


def criterion(branch: str) -> WeightedLoss:
    return WeightedLoss.from_config(
        {
            "om": {"loss": "optimal_matching", "weight": 0.1, "branch": branch},
            "div": {"loss": "query_diverse_focal", "weight": 0.003, "branch": branch},
        }
    )


def model_for(name: str, loss: WeightedLoss):
    """The backbone in training mode, exposing what the loss terms need (as the model factory asks)."""
    model = build(name).train()
    model.request(training=set().union(*(term.needs(training=True) for term in loss.losses.values())))
    return model


@pytest.mark.parametrize("name", NAMES)
def test_plug_in_losses_train_every_backbone(name):
    branch = next(iter(build(name).score_weights))  # clip (or moment)
    loss = criterion(branch)
    model = model_for(name, loss)
    batch = standard_batch()
    result = loss(model(batch), batch, epoch=0)
    result.total.backward()
    assert set(result.terms) == {"om", "div"} and torch.isfinite(result.total)
    assert result.terms["om"] > 0


@pytest.mark.parametrize("name", NAMES)
def test_plug_in_losses_with_one_query_per_video(name):
    branch = next(iter(build(name).score_weights))
    loss = criterion(branch)
    model = model_for(name, loss)
    batch = make_batch([3, 2, 4], [2, 3, 1], [0, 1, 2])
    result = loss(model(batch), batch, epoch=0)
    assert result.total.item() == 0.0
    result.total.backward()  # connected to the graph, no crash
