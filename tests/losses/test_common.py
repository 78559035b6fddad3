"""The helpers the losses share: a missing query branch is one clear error, whichever loss asks."""

from __future__ import annotations

import pytest
import torch
from loss_helpers import make_batch, make_output

from prvrlab.losses._common import query_vectors
from prvrlab.losses.moment_coverage import MomentCoverageLoss
from prvrlab.losses.optimal_matching import OptimalMatchingLoss
from prvrlab.losses.query_diverse import QueryDiverseLoss
from prvrlab.losses.query_diverse_focal import QueryDiverseFocalLoss


def test_query_vectors_are_the_branch_s_own_tensor():
    vectors = torch.randn(3, 4)  # (Nq, D)
    assert query_vectors(make_output(vectors=vectors, branch="frame"), "frame", "any") is vectors


@pytest.mark.parametrize(
    ("name", "loss"),
    [
        ("query_diverse", QueryDiverseLoss(branch="video")),
        ("query_diverse_focal", QueryDiverseFocalLoss(branch="video")),
        ("optimal_matching", OptimalMatchingLoss(branch="video")),
        ("moment_coverage", MomentCoverageLoss(branch="video")),
    ],
)
def test_a_branch_without_query_vectors_is_named_with_those_there_are(name, loss):
    out = make_output(vectors=torch.randn(3, 4), branch="frame")
    out.query.vectors["clip"] = torch.randn(3, 4)
    with pytest.raises(ValueError, match=rf"^{name}: branch='video' has no query vector; available: clip, frame$"):
        loss(out, make_batch([0, 0, 1], 2), epoch=0)
