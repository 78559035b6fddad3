"""Triplet loss against a hand-written loop."""

from __future__ import annotations

import pytest
import torch
from loss_helpers import make_batch, make_output

from prvrlab.losses.triplet import TripletLoss, sample_negatives
from prvrlab.registry import LOSSES
from device_under_test import DEVICE


def loop_triplet(sim, query_video, t2v_neg, v2t_neg, margin):
    """The reference formula with given negatives, one query / one video at a time."""
    nq, nv = len(sim), len(sim[0])
    t2v = 0.0
    for i in range(nq):
        if t2v_neg[i] < 0:
            continue
        assert t2v_neg[i] != query_video[i]
        t2v += max(0.0, margin + sim[i][t2v_neg[i]] - sim[i][query_video[i]])
    v2t = 0.0
    for v in range(nv):
        mine = [i for i in range(nq) if query_video[i] == v]
        if not mine or v2t_neg[v] < 0:
            continue
        assert query_video[v2t_neg[v]] != v
        pos = sum(sim[i][v] for i in mine) / len(mine)
        v2t += max(0.0, margin + sim[v2t_neg[v]][v] - pos)
    return t2v / nq + v2t / nv


def test_registered_with_its_hyperparameters():
    assert set(LOSSES.params("triplet")) == {
        "branch", "margin", "hard_negative_start_epoch", "hard_pool_size", "v2t_hard_pool_size"
    }


def test_single_negative_case_is_deterministic():
    # two videos, one query each: every item has exactly one negative
    sim = torch.tensor([[0.5, 0.45], [0.2, 0.6]], requires_grad=True)
    loss = TripletLoss(margin=0.1)(make_output(sim), make_batch([0, 1], 2), epoch=0)
    # t2v: q0: 0.1 + 0.45 - 0.5 = 0.05; q1: 0.1 + 0.2 - 0.6 < 0
    # v2t: v0: 0.1 + 0.2 - 0.5 < 0;    v1: 0.1 + 0.45 - 0.6 < 0
    assert loss.item() == pytest.approx(0.05 / 2)
    loss.backward()
    torch.testing.assert_close(sim.grad, torch.tensor([[-0.5, 0.5], [0.0, 0.0]]))


@pytest.mark.parametrize("epoch", [0, 25])
def test_random_negatives_match_loop(epoch):
    query_video = [0, 0, 1, 2, 2, 2, 3, 4, 4]
    nv = 6  # video 5 has no query in the batch
    sim = torch.rand(len(query_video), nv) * 2 - 1
    loss_fn = TripletLoss(margin=0.2, hard_negative_start_epoch=20, hard_pool_size=2)
    terms = loss_fn.compute(sim, torch.tensor(query_video), epoch=epoch, generator=torch.Generator(DEVICE).manual_seed(1))
    expected = loop_triplet(sim.tolist(), query_video, terms.t2v_negative.tolist(), terms.v2t_negative.tolist(), 0.2)
    assert terms.loss.item() == pytest.approx(expected, abs=1e-6)
    assert terms.v2t[5] == 0  # no positive: no term
    again = loss_fn.compute(sim, torch.tensor(query_video), epoch=epoch, generator=torch.Generator(DEVICE).manual_seed(1))
    assert torch.equal(again.t2v_negative, terms.t2v_negative)
    assert torch.equal(again.v2t_negative, terms.v2t_negative)


def test_forward_uses_the_branch_sim():
    sim = torch.rand(4, 3)
    out = make_output(sim, branch="frame")
    batch = make_batch([0, 1, 1, 2], 3)
    torch.manual_seed(5)
    a = TripletLoss(branch="frame")(out, batch, epoch=0)
    torch.manual_seed(5)
    b = TripletLoss().compute(sim, batch.query_video, epoch=0).loss
    assert a.item() == pytest.approx(b.item())
    with pytest.raises(ValueError, match="branch='clip'.*available: frame"):
        TripletLoss(branch="clip")(out, batch, epoch=0)


def test_branch_targets_replace_the_batch_videos_as_positives():
    """MS-SL's official frame scores: (Nq, Nq), query j's own-video vector in column j, positive on the
    diagonal; another query of the same video is a negative (get_frame_trip_loss)."""
    sim = torch.rand(5, 5) * 2 - 1
    batch = make_batch([0, 0, 1, 2, 2], 3)  # queries 0 and 1 share video 0
    loss_fn = TripletLoss(branch="frame", margin=0.2, v2t_hard_pool_size=20)
    torch.manual_seed(7)
    got = loss_fn(make_output(sim, branch="frame", targets=torch.arange(5)), batch, epoch=0)
    torch.manual_seed(7)
    terms = loss_fn.compute(sim, torch.arange(5), epoch=0)
    assert got.item() == pytest.approx(terms.loss.item())
    expected = loop_triplet(sim.tolist(), list(range(5)), terms.t2v_negative.tolist(), terms.v2t_negative.tolist(), 0.2)
    assert terms.loss.item() == pytest.approx(expected, abs=1e-6)
    assert terms.t2v_negative.tolist() != [-1] * 5 and (terms.t2v_negative != torch.arange(5)).all()


def test_hard_mode_samples_only_from_the_hardest():
    torch.manual_seed(0)
    nq, nv, pool = 200, 10, 3
    query_video = torch.randint(0, nv, (nq,))
    sim = torch.rand(nq, nv)
    loss_fn = TripletLoss(hard_negative_start_epoch=4, hard_pool_size=pool)
    hard = loss_fn.compute(sim, query_video, epoch=4).t2v_negative
    easy = loss_fn.compute(sim, query_video, epoch=3).t2v_negative
    ranks_hard, ranks_easy = [], []
    for i in range(nq):
        order = [v for v in sim[i].argsort(descending=True).tolist() if v != query_video[i]]
        ranks_hard.append(order.index(hard[i].item()))
        ranks_easy.append(order.index(easy[i].item()))
    assert max(ranks_hard) < pool
    assert set(ranks_hard) == set(range(pool))  # uniform over the pool, not always the hardest
    assert max(ranks_easy) >= pool  # before the start epoch: any negative


def test_v2t_hard_mode_samples_only_from_the_hardest():
    torch.manual_seed(1)
    nq, nv, pool = 30, 40, 4
    query_video = torch.randint(0, 3, (nq,))
    sim = torch.rand(nq, nv)
    loss_fn = TripletLoss(hard_negative_start_epoch=0, v2t_hard_pool_size=pool)
    chosen = torch.stack([loss_fn.compute(sim, query_video, epoch=0).v2t_negative for _ in range(20)])  # (20, Nv)
    default = TripletLoss(hard_negative_start_epoch=0).compute(sim, query_video, epoch=0).v2t_negative
    for v in range(nv):
        negatives = [i for i in range(nq) if query_video[i] != v]
        order = sorted(negatives, key=lambda i: -sim[i, v].item())
        assert set(chosen[:, v].tolist()) <= set(order[:pool])
        assert default[v].item() == order[0]  # the reference: the hardest query
    assert len(set(chosen[:, 0].tolist())) > 1


def test_sample_negatives_without_candidates():
    chosen = sample_negatives(torch.rand(2, 3), torch.tensor([[0, 0, 0], [0, 1, 0]], dtype=torch.bool), None)
    assert chosen.tolist() == [-1, 1]
    one_video = TripletLoss().compute(torch.rand(3, 1), torch.zeros(3, dtype=torch.long), epoch=0)
    assert one_video.loss.item() == 0.0


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"margin": -0.1}, "margin"),
        ({"margin": float("nan")}, "margin"),
        ({"hard_pool_size": 0}, "hard_pool_size"),
        ({"hard_negative_start_epoch": -1}, "hard_negative_start_epoch"),
        ({"v2t_hard_pool_size": 0}, "v2t_hard_pool_size"),
        ({"branch": ""}, "branch"),
        ({"branch": 3}, "branch"),
    ],
)
def test_invalid_hyperparameters(kwargs, param):
    with pytest.raises(ValueError, match=param):
        TripletLoss(**kwargs)
