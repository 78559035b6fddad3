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


@pytest.mark.parity
def test_shifted_warmup_then_linear_decay_to_zero():
    f = warmup_linear(100, 0.1, "shifted")
    assert f(0) == pytest.approx(0.1)
    assert f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0)
    assert f(55) == pytest.approx(0.5)
    assert f(100) == 0.0


@pytest.mark.parity
@pytest.mark.parametrize("warmup", ["official", "shifted"])
def test_warmup_multipliers_per_step_drive_the_learning_rate(warmup):
    total, proportion, base = 20, 0.25, 2.0
    W = proportion * total  # 5 warm-up steps
    shift = 1 if warmup == "shifted" else 0
    expected = [base * ((s + shift) / W if s < W else (total - s) / (total - W)) for s in range(total)]
    p = nn.Parameter(torch.tensor([1.0]))
    opt, sched = build_optimizer(
        nn.ParameterList([p]), lr=base, weight_decay=0.0, total_steps=total, warmup_proportion=proportion, warmup=warmup
    )
    lrs = []
    for _ in range(total):
        lrs.append(opt.param_groups[0]["lr"])
        p.grad = torch.ones(1)
        opt.step()
        sched.step()
    assert lrs == pytest.approx(expected)
    assert (lrs[0] == 0.0) == (warmup == "official")  # the reference's first step does not move the weights


@pytest.mark.parity
def test_official_warmup_is_the_default():
    assert warmup_linear(100, 0.1)(0) == 0.0
    assert warmup_linear(100, 0.1)(5) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="warmup"):
        warmup_linear(100, 0.1, "late")


def _two_tensors() -> tuple[nn.Parameter, nn.Parameter, torch.Tensor, torch.Tensor]:
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    return a, b, torch.tensor([3.0, 4.0]), torch.tensor([1.0, 0.0])  # gradient norms 5 and 1


def _first_moment(opt: BertAdam, p: nn.Parameter) -> list[float]:
    return (opt.state[p]["exp_avg"] / 0.1).tolist()  # beta1 = 0.9: exp_avg = 0.1 * gradient used


@pytest.mark.parity
def test_per_tensor_clipping_rescales_each_tensor_on_its_own():
    a, b, ga, gb = _two_tensors()
    opt = BertAdam([a, b], lr=0.1, max_grad_norm=2.0)
    a.grad, b.grad = ga.clone(), gb.clone()
    opt.step()
    assert _first_moment(opt, a) == pytest.approx([3.0 * 2 / 5, 4.0 * 2 / 5], rel=1e-5)  # norm 5 -> 2
    assert _first_moment(opt, b) == pytest.approx([1.0, 0.0], rel=1e-5)  # norm 1 <= 2: untouched


@pytest.mark.parity
def test_global_clipping_rescales_all_tensors_by_the_total_norm():
    a, b, ga, gb = _two_tensors()
    opt = BertAdam([a, b], lr=0.1)  # the trainer clips (train.clip_grad: global)
    a.grad, b.grad = ga.clone(), gb.clone()
    torch.nn.utils.clip_grad_norm_([a, b], 2.0)
    opt.step()
    scale = 2.0 / math.sqrt(25 + 1)
    assert _first_moment(opt, a) == pytest.approx([3.0 * scale, 4.0 * scale], rel=1e-5)
    assert _first_moment(opt, b) == pytest.approx([1.0 * scale, 0.0], rel=1e-5)


@pytest.mark.parity
def test_zero_grad_clip_means_no_clipping():
    a, b, ga, gb = _two_tensors()
    opt = BertAdam([a, b], lr=0.1, max_grad_norm=0.0)
    a.grad, b.grad = ga.clone(), gb.clone()
    opt.step()
    assert _first_moment(opt, a) == pytest.approx([3.0, 4.0], rel=1e-5)
    with pytest.raises(ValueError, match="max_grad_norm"):
        BertAdam([a], lr=0.1, max_grad_norm=-1.0)


@pytest.mark.parity
def test_per_tensor_clipping_sees_unscaled_gradients_under_a_grad_scaler():
    a, b, ga, gb = _two_tensors()
    opt = BertAdam([a, b], lr=0.1, max_grad_norm=2.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    loss = (a * ga).sum() + (b * gb).sum()  # gradients ga, gb
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert _first_moment(opt, a) == pytest.approx([1.2, 1.6], rel=1e-5)
    assert _first_moment(opt, b) == pytest.approx([1.0, 0.0], rel=1e-5)


def test_scheduler_drives_the_learning_rate():
    model = nn.Linear(2, 2)
    opt, sched = build_optimizer(model, lr=1.0, weight_decay=0.0, total_steps=10, warmup_proportion=0.0)
    lrs = []
    for _ in range(10):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([1.0 - i / 10 for i in range(10)])


@pytest.mark.parity
@pytest.mark.parametrize("total, proportion", [(120, 0.01), (50, 0.05), (40, 0.01)])  # W = 1.2, 2.5, 0.4
def test_shifted_warmup_with_a_fractional_length_never_exceeds_the_full_lr(total, proportion):
    W = proportion * total
    expected = []
    for s in range(total + 1):
        if s < W:
            expected.append(min(1.0, (s + 1) / W))  # (s + 1) / W reaches 1 before s reaches W: held there
        else:
            expected.append((total - s) / (total - W))
    f = warmup_linear(total, proportion, "shifted")
    factors = [f(s) for s in range(total + 1)]
    assert factors == pytest.approx(expected)
    assert max(factors) == pytest.approx(1.0)  # the peak is the configured lr, not 1 / (W - floor(W)) times it
    assert factors[math.ceil(W) - 1] == pytest.approx(1.0)  # the last warm-up step reaches the full lr
    assert all(a <= b + 1e-12 for a, b in zip(factors, factors[1:math.ceil(W)]))  # warm-up only rises
