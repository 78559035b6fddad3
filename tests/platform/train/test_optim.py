"""The reference optimiser recipe against hand-computed updates."""

import math

import pytest
import torch
from torch import nn

from prvrlab.platform.train.optim import BertAdam, build_optimizer, param_groups, warmup_linear


def test_bert_adam_matches_hand_computed_steps_without_bias_correction():
    p = nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = BertAdam([p], lr=0.1, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01)
    grads = [torch.tensor([0.5, -1.0]), torch.tensor([0.2, 0.3])]
    m = [0.0, 0.0]
    v = [0.0, 0.0]
    expected = [1.0, -2.0]
    for g in grads:
        p.grad = g.clone()
        opt.step()
        for i in range(2):
            m[i] = 0.9 * m[i] + 0.1 * float(g[i])
            v[i] = 0.999 * v[i] + 0.001 * float(g[i]) ** 2
            update = m[i] / (math.sqrt(v[i]) + 1e-6) + 0.01 * expected[i]
            expected[i] -= 0.1 * update
    assert p.detach().tolist() == pytest.approx(expected, rel=1e-5)


def test_no_weight_decay_on_bias_and_layernorm():
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    groups = param_groups(model, 0.01)
    decayed = {id(p) for p in groups[0]["params"]}
    assert decayed == {id(model[0].weight)}
    assert groups[1]["weight_decay"] == 0.0 and len(groups[1]["params"]) == 3


def test_warmup_then_linear_decay_to_zero():
    f = warmup_linear(100, 0.1)
    assert f(0) == pytest.approx(0.1)
    assert f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0)
    assert f(55) == pytest.approx(0.5)
    assert f(100) == 0.0


def test_scheduler_drives_the_learning_rate():
    model = nn.Linear(2, 2)
    opt, sched = build_optimizer(model, lr=1.0, weight_decay=0.0, total_steps=10, warmup_proportion=0.0)
    lrs = []
    for _ in range(10):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([1.0 - i / 10 for i in range(10)])
