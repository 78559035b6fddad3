"""Query-diverse loss: a worked example and a hand-written loop."""

from __future__ import annotations

import math

import pytest
import torch
from loss_helpers import make_batch, make_output

from prvrlab.losses.query_diverse import QueryDiverseLoss


def loop_query_diverse(vectors, query_video, alpha, delta):
    def cos(a, b):
        dot = sum(x * y for x, y in zip(a, b))
        return dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))

    per_query = []
    for i in range(len(vectors)):
        partners = [j for j in range(len(vectors)) if j != i and query_video[j] == query_video[i]]
        if partners:
            s = sum(math.exp(alpha * (cos(vectors[i], vectors[j]) + delta)) for j in partners)
            per_query.append(math.log(1 + s))
    return sum(per_query) / len(vectors)


def test_worked_example():
    # q0 and q1 (video 0) are orthogonal, q2 is alone in video 1:
    # l0 = l1 = log(1 + exp(32 * (0 + 0.2))) = log(1 + e^6.4) = 6.40166, l2 = 0; loss = (l0 + l1 + l2) / 3
    vectors = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 0.0]])
    loss = QueryDiverseLoss(alpha=32.0, delta=0.2)(make_output(vectors=vectors), make_batch([0, 0, 1], 2), epoch=0)
    assert loss.item() == pytest.approx(2 * math.log(1 + math.exp(6.4)) / 3, rel=1e-6)
    assert loss.item() == pytest.approx(2 * 6.40166 / 3, abs=1e-4)
    # three queries of one video 120 degrees apart: each has two partners with cos -0.5
    angles = torch.tensor([0.0, 2 * math.pi / 3, 4 * math.pi / 3])
    vectors = torch.stack([angles.cos(), angles.sin()], dim=1)
    loss = QueryDiverseLoss(alpha=2.0, delta=0.1)(make_output(vectors=vectors), make_batch([0, 0, 0], 1), epoch=0)
    assert loss.item() == pytest.approx(math.log(1 + 2 * math.exp(2.0 * (-0.5 + 0.1))), rel=1e-6)


def test_matches_loop():
    torch.manual_seed(0)
    query_video = [0, 0, 0, 1, 2, 2, 3]
    vectors = torch.randn(7, 5, requires_grad=True)
    loss = QueryDiverseLoss(alpha=8.0, delta=0.15)(make_output(vectors=vectors), make_batch(query_video, 4), epoch=0)
    assert loss.item() == pytest.approx(loop_query_diverse(vectors.tolist(), query_video, 8.0, 0.15), rel=1e-5)
    loss.backward()
    assert torch.isfinite(vectors.grad).all()
    assert torch.all(vectors.grad[3] == 0) and torch.all(vectors.grad[6] == 0)  # no partner


def test_large_alpha_is_stable():
    vectors = torch.tensor([[1.0, 0.0], [1.0, 1e-3]], requires_grad=True)
    loss = QueryDiverseLoss(alpha=1e4, delta=0.2)(make_output(vectors=vectors), make_batch([0, 0], 1), epoch=0)
    assert math.isfinite(loss.item()) and loss.item() == pytest.approx(1.2e4, rel=1e-3)
    loss.backward()
    assert torch.isfinite(vectors.grad).all()


def test_no_video_with_two_queries_gives_grad_safe_zero():
    vectors = torch.randn(3, 4, requires_grad=True)
    loss = QueryDiverseLoss()(make_output(vectors=vectors), make_batch([0, 1, 2], 3), epoch=0)
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(vectors.grad, torch.zeros(3, 4))


@pytest.mark.parametrize(
    "kwargs, param",
    [({"alpha": 0.0}, "alpha"), ({"alpha": -1.0}, "alpha"), ({"delta": -0.1}, "delta"), ({"branch": ""}, "branch")],
)
def test_invalid_hyperparameters(kwargs, param):
    with pytest.raises(ValueError, match=param):
        QueryDiverseLoss(**kwargs)


def test_missing_branch_is_a_clear_error():
    with pytest.raises(ValueError, match="branch='frame'"):
        QueryDiverseLoss(branch="frame")(make_output(vectors=torch.randn(2, 3)), make_batch([0, 0], 1), epoch=0)
