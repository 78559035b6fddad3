"""The focal query-diverse loss keeps its value, not only finiteness, where alpha (c + delta) is huge:
softplus(x) = x there, so each ordered pair costs (1 + c)^gamma * alpha * (c + delta)."""

from __future__ import annotations

import pytest
import torch
from loss_helpers import make_batch, make_output

from prvrlab.losses.query_diverse_focal import QueryDiverseFocalLoss


@pytest.mark.parametrize("gamma", [0.0, 1.0, 2.0])
def test_large_alpha_gives_the_linear_branch_of_softplus_and_its_gradient(gamma):
    alpha, delta = 1e4, 0.2
    start = [[1.0, 0.0], [1.0, 1e-3]]
    vectors = torch.tensor(start, requires_grad=True)
    loss = QueryDiverseFocalLoss(alpha=alpha, delta=delta, gamma=gamma)(
        make_output(vectors=vectors), make_batch([0, 0], 1), epoch=0)
    loss.backward()

    exact = torch.tensor(start, dtype=torch.float64, requires_grad=True)
    c = torch.nn.functional.cosine_similarity(exact[0], exact[1], dim=0)
    # two queries of one video: two ordered pairs of equal cost, over two queries ("query" reduction)
    expected = (1 + c) ** gamma * alpha * (c + delta)
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert torch.allclose(vectors.grad.double(), exact.grad, rtol=2e-3, atol=1e-3 * exact.grad.abs().max().item())
