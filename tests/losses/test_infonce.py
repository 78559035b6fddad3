"""InfoNCE against a hand-written loop."""

from __future__ import annotations

import math

import pytest
import torch
from loss_helpers import make_batch, make_output

from prvrlab.losses.infonce import InfoNCELoss


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
