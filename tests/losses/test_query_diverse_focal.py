"""Revamped query-diverse loss: hand-written loops, gamma = 0 = uniform push, reductions."""

from __future__ import annotations

import math

import pytest
import torch
from loss_helpers import make_batch, make_output

from prvrlab.losses.query_diverse import QueryDiverseLoss
from prvrlab.losses.query_diverse_focal import QueryDiverseFocalLoss
from prvrlab.registry import LOSSES


def cos(a, b):
    return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def loop_loss(vectors, query_video, alpha, delta, gamma, reduction="query"):
    per_video: dict[int, list[float]] = {}
    for i in range(len(vectors)):
        for j in range(len(vectors)):
            if i != j and query_video[i] == query_video[j]:
                c = cos(vectors[i], vectors[j])
                term = (1 + c) ** gamma * math.log(1 + math.exp(alpha * (c + delta)))
                per_video.setdefault(query_video[i], []).append(term)
    if reduction == "query":
        return sum(sum(v) for v in per_video.values()) / len(vectors)
    means = [sum(v) / len(v) for v in per_video.values()]
    return sum(means) / len(means) if means else 0.0


@pytest.mark.parametrize("gamma", [0.0, 1.0, 2.5])
@pytest.mark.parametrize("reduction", ["query", "pair"])
def test_matches_loop(gamma, reduction):
    torch.manual_seed(0)
    query_video = [0, 0, 0, 1, 2, 2, 3, 3, 3, 3]
    vectors = torch.randn(10, 5, requires_grad=True)
    loss_fn = QueryDiverseFocalLoss(alpha=8.0, delta=0.15, gamma=gamma, reduction=reduction)
    loss = loss_fn(make_output(vectors=vectors), make_batch(query_video, 4), epoch=0)
    expected = loop_loss(vectors.tolist(), query_video, 8.0, 0.15, gamma, reduction)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    loss.backward()
    assert torch.isfinite(vectors.grad).all()
    assert torch.all(vectors.grad[3] == 0)  # video 1 has a single query


def eq5_as_printed(vectors, query_video, alpha, delta, gamma):
    """GMMFormer v2's Eq. 5 literally: per video 2 / (M (M - 1)) times the sum over ordered pairs i != j,
    averaged over the videos with M >= 2 queries."""
    per_video = []
    for v in sorted(set(query_video)):
        members = [i for i, video in enumerate(query_video) if video == v]
        M = len(members)
        if M < 2:
            continue
        total = 0.0
        for i in members:
            for j in members:
                if i != j:
                    c = cos(vectors[i], vectors[j])
                    total += (1 + c) ** gamma * math.log(1 + math.exp(alpha * (c + delta)))
        per_video.append(2.0 / (M * (M - 1)) * total)
    return sum(per_video) / len(per_video)


@pytest.mark.parity
@pytest.mark.parametrize("gamma", [0.0, 1.0])
def test_eq5_as_printed_is_twice_the_pair_reduction(gamma):
    torch.manual_seed(1)
    query_video = [0, 0, 0, 1, 2, 2, 3, 3, 3, 3]
    vectors = torch.randn(10, 5)
    loss_fn = QueryDiverseFocalLoss(alpha=8.0, delta=0.15, gamma=gamma, reduction="pair")
    got = loss_fn(make_output(vectors=vectors), make_batch(query_video, 4), epoch=0)
    assert 2 * got.item() == pytest.approx(eq5_as_printed(vectors.tolist(), query_video, 8.0, 0.15, gamma), rel=1e-5)


def test_worked_example():
    # q0, q1 of video 0 at 60 degrees (cos 0.5): l = (1.5)^1 * log(1 + e^{32 * 0.7}) per ordered pair;
    # 2 ordered pairs / 2 queries
    vectors = torch.tensor([[1.0, 0.0], [0.5, math.sqrt(3) / 2]])
    loss = QueryDiverseFocalLoss()(make_output(vectors=vectors), make_batch([0, 0], 1), epoch=0)
    assert loss.item() == pytest.approx(1.5 * math.log1p(math.exp(22.4)), rel=1e-5)


def test_gamma_zero_is_the_uniform_push():
    # uniform push: every same-video ordered pair pushed by softplus(alpha (cos + delta)), sum / N_q
    torch.manual_seed(1)
    query_video = [0, 0, 0, 1, 1]
    vectors = torch.randn(5, 4)
    got = QueryDiverseFocalLoss(alpha=4.0, delta=0.2, gamma=0.0)(
        make_output(vectors=vectors), make_batch(query_video, 2), epoch=0
    )
    v = vectors.tolist()
    total = sum(
        math.log1p(math.exp(4.0 * (cos(v[i], v[j]) + 0.2)))
        for i in range(5)
        for j in range(5)
        if i != j and query_video[i] == query_video[j]
    )
    assert got.item() == pytest.approx(total / 5, rel=1e-6)


def test_gamma_zero_equals_v1_when_every_video_has_at_most_two_queries():
    torch.manual_seed(2)
    query_video = [0, 0, 1, 2, 2]
    vectors = torch.randn(5, 6)
    out, batch = make_output(vectors=vectors), make_batch(query_video, 3)
    v1 = QueryDiverseLoss(alpha=32.0, delta=0.2)(out, batch, epoch=0)
    v2 = QueryDiverseFocalLoss(alpha=32.0, delta=0.2, gamma=0.0)(out, batch, epoch=0)
    assert v2.item() == pytest.approx(v1.item(), rel=1e-6)
    # with three queries per video the uniform push bounds v1 from above
    three = make_batch([0, 0, 0, 1, 1], 2)
    assert QueryDiverseFocalLoss(gamma=0.0)(out, three, epoch=0) > QueryDiverseLoss()(out, three, epoch=0)


def test_focusing_down_weights_well_separated_pairs():
    vectors = torch.tensor([[1.0, 0.0], [-0.9, math.sqrt(1 - 0.81)]])  # cos -0.9: well preserved
    out, batch = make_output(vectors=vectors), make_batch([0, 0], 1)
    flat = QueryDiverseFocalLoss(alpha=2.0, gamma=0.0)(out, batch, epoch=0)
    focal = QueryDiverseFocalLoss(alpha=2.0, gamma=2.0)(out, batch, epoch=0)
    assert focal.item() == pytest.approx(flat.item() * 0.1**2, rel=1e-4)


def test_no_pairs_gives_grad_safe_zero():
    vectors = torch.randn(3, 4, requires_grad=True)
    for reduction in ("query", "pair"):
        loss_fn = QueryDiverseFocalLoss(reduction=reduction)
        loss = loss_fn(make_output(vectors=vectors), make_batch([0, 1, 2], 3), epoch=0)
        assert loss.item() == 0.0
        loss.backward()
        assert torch.equal(vectors.grad, torch.zeros(3, 4))


def test_large_alpha_is_stable():
    vectors = torch.tensor([[1.0, 0.0], [1.0, 1e-3]], requires_grad=True)
    loss = QueryDiverseFocalLoss(alpha=1e4)(make_output(vectors=vectors), make_batch([0, 0], 1), epoch=0)
    assert math.isfinite(loss.item())
    loss.backward()
    assert torch.isfinite(vectors.grad).all()


def test_registered_with_keyword_parameters():
    loss = LOSSES.build("query_diverse_focal", branch="frame", alpha=16.0, delta=0.1, gamma=0.5)
    assert (loss.branch, loss.alpha, loss.delta, loss.gamma, loss.reduction) == ("frame", 16.0, 0.1, 0.5, "query")


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"alpha": 0.0}, "alpha"),
        ({"delta": -0.1}, "delta"),
        ({"gamma": -1.0}, "gamma"),
        ({"gamma": float("nan")}, "gamma"),
        ({"reduction": "mean"}, "reduction"),
        ({"branch": "a b"}, "branch"),
    ],
)
def test_invalid_hyperparameters(kwargs, param):
    with pytest.raises(ValueError, match=param):
        QueryDiverseFocalLoss(**kwargs)


def test_missing_branch_is_a_clear_error():
    with pytest.raises(ValueError, match="branch='frame'"):
        QueryDiverseFocalLoss(branch="frame")(make_output(vectors=torch.randn(2, 3)), make_batch([0, 0], 1), epoch=0)


@pytest.mark.parametrize("gamma", [0.3, 0.5, 1.0])
def test_antipodal_queries_keep_the_value_and_give_finite_gradients(gamma):
    """(1 + c)^gamma has an infinite slope at c = -1 for gamma < 1: antipodal queries of other videos (no
    pair: masked) and of the same video must neither make a NaN gradient nor change the value; the other
    pairs' gradients are autograd's of the plain formula in float64."""
    torch.manual_seed(0)
    base = torch.randn(6, 5)
    base[0], base[1] = torch.tensor([2.0, 0, 0, 0, 0]), torch.tensor([-3.0, 0, 0, 0, 0])  # same video, cos = -1
    base[2], base[4] = torch.tensor([0, 1.0, 0, 0, 0]), torch.tensor([0, -0.5, 0, 0, 0])  # other videos, cos = -1
    query_video = [0, 0, 1, 1, 2, 2]
    vectors = base.clone().requires_grad_(True)
    loss_fn = QueryDiverseFocalLoss(alpha=4.0, delta=0.2, gamma=gamma)
    loss = loss_fn(make_output(vectors=vectors), make_batch(query_video, 3), epoch=0)
    # float32's 1 + c of the antipodal pair is 0 give or take its eps: (2 eps)^gamma bounds that factor
    expected = loop_loss(base.tolist(), query_video, 4.0, 0.2, gamma)
    assert loss.item() == pytest.approx(expected, rel=1e-5, abs=(2 * torch.finfo(torch.float32).eps) ** gamma)
    loss.backward()
    assert torch.isfinite(vectors.grad).all()
    plain = base.double().requires_grad_(True)  # videos 1 and 2 have no antipodal pair: the plain formula
    q = torch.nn.functional.normalize(plain, dim=-1)
    total = 0.0
    for i, j in ((2, 3), (3, 2), (4, 5), (5, 4)):
        c = q[i] @ q[j]
        total = total + (1 + c) ** gamma * torch.nn.functional.softplus(4.0 * (c + 0.2))
    (total / 6).backward()
    torch.testing.assert_close(vectors.grad[2:].double(), plain.grad[2:], rtol=1e-4, atol=1e-6)
