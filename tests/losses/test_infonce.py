"""InfoNCE against a hand-written loop."""

from __future__ import annotations

import math

import pytest
import torch
from loss_helpers import make_batch, make_output

from prvrlab.losses.infonce import InfoNCELoss, infonce


def loop_infonce(logits, query_video):
    nq, nv = len(logits), len(logits[0])
    t2v = []
    for i in range(nq):
        denom = sum(math.exp(logits[i][v]) for v in range(nv))
        t2v.append(-math.log(math.exp(logits[i][query_video[i]]) / denom))
    v2t = []
    for v in range(nv):
        mine = [i for i in range(nq) if query_video[i] == v]
        if not mine:
            continue
        num = sum(math.exp(logits[i][v]) for i in mine)
        denom = sum(math.exp(logits[i][v]) for i in range(nq))
        v2t.append(-math.log(num / denom))
    return sum(t2v) / len(t2v) + sum(v2t) / len(v2t)


@pytest.mark.parametrize("seed", [0, 1])
def test_matches_loop(seed):
    torch.manual_seed(seed)
    query_video = [0, 0, 0, 1, 2, 2, 3]
    logits = (torch.randn(len(query_video), 5) * 3).requires_grad_()  # video 4 has no query
    loss = InfoNCELoss()(make_output(torch.zeros(7, 5), logits), make_batch(query_video, 5), epoch=0)
    assert loss.item() == pytest.approx(loop_infonce(logits.tolist(), query_video), rel=1e-5)
    loss.backward()
    assert torch.isfinite(logits.grad).all()


def test_large_logits_are_stable():
    logits = torch.tensor([[300.0, -300.0], [250.0, 280.0]], requires_grad=True)
    loss = InfoNCELoss()(make_output(torch.zeros(2, 2), logits), make_batch([0, 1], 2), epoch=0)
    assert math.isfinite(loss.item())
    loss.backward()
    assert torch.isfinite(logits.grad).all()


def test_missing_logits_or_branch_is_a_clear_error():
    batch = make_batch([0, 1], 2)
    with pytest.raises(ValueError, match="branch='clip' has no logits"):
        InfoNCELoss()(make_output(torch.zeros(2, 2), None), batch, epoch=0)
    with pytest.raises(ValueError, match="branch='frame'.*available: clip"):
        InfoNCELoss(branch="frame")(make_output(torch.zeros(2, 2), torch.zeros(2, 2)), batch, epoch=0)
    with pytest.raises(ValueError, match="branch"):
        InfoNCELoss(branch="not a name")


def loop_joint(logits, query_video, *, siblings_out=True):
    """MS-SL's official frame_nce, generalised: per query one softmax over its row and its video's column,
    the column without i's siblings (their entry there is their own positive)."""
    nq = len(logits)
    total = 0.0
    for i in range(nq):
        v = query_video[i]
        column = [k for k in range(nq) if k == i or query_video[k] != v or not siblings_out]
        denom = sum(math.exp(x) for x in logits[i]) + sum(math.exp(logits[k][v]) for k in column)
        total += -math.log(math.exp(logits[i][v]) / denom)
    return total / nq


def test_joint_form_on_a_square_matrix_is_the_official_frame_nce():
    """MS-SL's frame_nce on (N, N) scores: x.view(N, N, 1); numerator = the diagonal; denominator =
    logsumexp of row i and column i concatenated (2N entries); mean over i."""
    torch.manual_seed(3)
    x = (torch.randn(5, 5) * 2).requires_grad_()
    targets = torch.arange(5)
    # the batch says queries 0, 1 share video 0: the targets, not the batch, decide the positives
    batch = make_batch([0, 0, 1, 2, 2], 3)
    loss = InfoNCELoss(branch="frame", form="joint")(
        make_output(torch.zeros(5, 5), x, branch="frame", targets=targets), batch, epoch=0
    )
    rows = x.tolist()
    official = sum(
        -rows[i][i] + math.log(sum(math.exp(rows[i][j]) + math.exp(rows[j][i]) for j in range(5))) for i in range(5)
    ) / 5
    assert loss.item() == pytest.approx(official, rel=1e-6)
    loss.backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("seed", [0, 1])
def test_joint_form_with_video_columns_matches_loop(seed):
    torch.manual_seed(seed)
    query_video = [0, 0, 0, 1, 2, 2, 3]
    logits = torch.randn(len(query_video), 5) * 3
    loss = InfoNCELoss(form="joint")(make_output(torch.zeros(7, 5), logits), make_batch(query_video, 5), epoch=0)
    assert loss.item() == pytest.approx(loop_joint(logits.tolist(), query_video), rel=1e-5)
    assert loss.item() < loop_joint(logits.tolist(), query_video, siblings_out=False)  # siblings were negatives


def test_joint_form_with_video_columns_rewards_every_positive():
    """Perfect retrieval by a wide margin: the loss approaches its floor, log 2 (the positive is counted in
    the row and in the column), and raising every positive lowers it; with siblings as negatives a video
    of 3 queries stayed at log 4 whatever the scores."""
    query_video = torch.tensor([0, 0, 0, 1])
    logits = torch.full((4, 2), -10.0)
    logits[torch.arange(4), query_video] = 10.0
    low = infonce(logits, query_video, form="joint")
    assert low.item() == pytest.approx(math.log(2), abs=1e-6)
    near = (logits / 10).requires_grad_(True)  # a margin of 2: gradients above float32's resolution
    grad, = torch.autograd.grad(infonce(near, query_video, form="joint"), near)
    assert (grad[torch.arange(4), query_video] < -1e-3).all()  # every positive pulled up
    old = loop_joint(logits.tolist(), query_video.tolist(), siblings_out=False)
    assert old > math.log(3)  # the defect: siblings' positives in the denominator


def test_two_sided_form_reads_the_branch_targets():
    torch.manual_seed(4)
    logits = torch.randn(4, 4)
    out = make_output(torch.zeros(4, 4), logits, targets=torch.arange(4))
    loss = InfoNCELoss()(out, make_batch([0, 0, 1, 1], 2), epoch=0)
    assert loss.item() == pytest.approx(loop_infonce(logits.tolist(), [0, 1, 2, 3]), rel=1e-5)


def test_unknown_form_names_the_choices():
    with pytest.raises(ValueError, match="form.*two_sided.*joint"):
        InfoNCELoss(form="both")
