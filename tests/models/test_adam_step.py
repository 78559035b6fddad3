"""The one-pass BertAdam update (prvrlab/models/adam_step.py) against the formula in float64 and against the
optimiser's foreach form."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from prvrlab.models import adam_step
from prvrlab.platform.train.optim import BertAdam
from prvrlab.vector_math import settle_vector_math

pytestmark = pytest.mark.skipif(adam_step.load() is None, reason="no C++ compiler to build the kernel")
ROUNDS_AS_ATEN = torch.backends.cpu.get_cpu_capability() in adam_step.FMA_CAPABILITIES


@pytest.fixture(autouse=True, scope="module")
def _settled_sqrt():
    """torch 2.13's first square root in a process can be ~4,000 ulp off for the elements a second thread
    computes (prvrlab/vector_math.py); the foreach form compared below would carry that."""
    settle_vector_math()

# sizes that put thread boundaries inside tensors, tails shorter than a vector, and a tensor of one element
SHAPES = [(3,), (40_000,), (384, 300), (17, 33), (1,), (70_001,)]


def _tensors(gen: torch.Generator, shapes=SHAPES) -> list[torch.Tensor]:
    return [torch.randn(s, generator=gen) for s in shapes]


def test_one_update_is_the_formula_in_float64():
    gen = torch.Generator().manual_seed(0)
    p, g, m = _tensors(gen), _tensors(gen), _tensors(gen)
    v = [t.abs() * 0.01 for t in _tensors(gen)]
    scales = [1.0, 0.25, 1.0, 0.5, 1.0, 0.125]
    before = [[t.double() for t in ts] for ts in (p, g, m, v)]
    versions = [t._version for t in p]
    lr, b1, b2, eps, wd = 0.01, 0.8, 0.99, 1e-6, 0.05
    threads = torch.get_num_threads()
    torch.set_num_threads(3)  # three element ranges over six tensors: boundaries inside tensors
    try:
        adam_step.step(p, g, m, v, scales=scales, lr=lr, b1=b1, b2=b2, eps=eps, weight_decay=wd)
    finally:
        torch.set_num_threads(threads)
    for i, (p0, g0, m0, v0) in enumerate(zip(*before)):
        gs = g0 * scales[i]
        m1 = b1 * m0 + (1 - b1) * gs
        v1 = b2 * v0 + (1 - b2) * gs * gs
        step = lr * (m1 / (v1.sqrt() + eps) + wd * p0)
        p1 = p0 - step
        torch.testing.assert_close(m[i].double(), m1, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(v[i].double(), v1, rtol=1e-6, atol=1e-9)
        # float32 roundings of p0, of the step (which can be far larger than p1) and of m1's two terms (which
        # can nearly cancel), the last carried through the division
        terms = lr * (b1 * m0.abs() + (1 - b1) * gs.abs()) / (v1.sqrt() + eps)
        assert ((p[i].double() - p1).abs() <= 1e-6 * (p0.abs() + step.abs() + terms)).all(), i
        assert torch.equal(g[i].double(), g0), "the gradient is read, not scaled in place"
    assert all(t._version > n for t, n in zip(p, versions)), "an in-place update counts in the version"


def _train(fused: bool, clip: float, steps: int = 4) -> tuple[list[nn.Parameter], BertAdam]:
    gen = torch.Generator().manual_seed(1)
    params = [nn.Parameter(t) for t in _tensors(gen)]
    groups = [{"params": params[:3]}, {"params": params[3:], "weight_decay": 0.0}]
    opt = BertAdam(groups, lr=0.05, weight_decay=0.01, max_grad_norm=clip, fused=fused)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * 3
        params[2].grad = None  # a parameter without a gradient is left alone
        opt.step()
    return params, opt


@pytest.mark.skipif(not ROUNDS_AS_ATEN, reason="ATen's DEFAULT kernels round an add with alpha twice: no fused path")
@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_the_fused_optimiser_follows_the_foreach_form(clip):
    plain, plain_opt = _train(False, clip)
    fused, fused_opt = _train(True, clip)
    for a, b in zip(plain, fused):
        # the moments round as ATen's ops do: the same bits; the parameters go through a square root that
        # ATen (MKL) rounds differently in the last bit
        if a.grad is None:
            assert torch.equal(a, b) and b not in fused_opt.state
            continue
        assert torch.equal(plain_opt.state[a]["exp_avg"], fused_opt.state[b]["exp_avg"])
        torch.testing.assert_close(fused_opt.state[b]["exp_avg_sq"], plain_opt.state[a]["exp_avg_sq"], rtol=2e-7, atol=0)
        torch.testing.assert_close(b.detach(), a.detach(), rtol=1e-6, atol=1e-7)
    moved = max((a - b).abs().max().item() for a, b in zip(plain, _train(False, clip, steps=0)[0]))
    assert moved > 0.1, "the steps moved the parameters"


def test_tensors_the_kernel_does_not_take_get_the_foreach_form():
    p = torch.randn(6, 4)
    assert adam_step.takes([p], [torch.randn(6, 4)]) == ROUNDS_AS_ATEN
    assert not adam_step.takes([p.t()])  # not contiguous
    assert not adam_step.takes([p.double()])
    a = nn.Parameter(torch.tensor([1.0, -2.0], dtype=torch.float64))
    opt = BertAdam([a], lr=0.1, weight_decay=0.01)  # fused, but float64: the foreach form
    a.grad = torch.tensor([0.5, -1.0], dtype=torch.float64)
    opt.step()
    want = [x - 0.1 * (0.1 * g / (math.sqrt(0.001 * g * g) + 1e-6) + 0.01 * x) for x, g in ((1.0, 0.5), (-2.0, -1.0))]
    assert a.detach().tolist() == pytest.approx(want, rel=1e-12)


def test_lists_of_different_lengths_or_shapes_are_refused():
    p = [torch.zeros(3)]
    with pytest.raises(ValueError, match="one length"):
        adam_step.step(p, p, p, [], scales=None, lr=0.1, b1=0.9, b2=0.999, eps=1e-6, weight_decay=0.0)
    with pytest.raises(ValueError, match="one factor per tensor"):
        adam_step.step(p, p, p, p, scales=[1.0, 1.0], lr=0.1, b1=0.9, b2=0.999, eps=1e-6, weight_decay=0.0)
    with pytest.raises(ValueError, match="tensor 0"):
        adam_step.step(p, [torch.zeros(4)], p, p, scales=None, lr=0.1, b1=0.9, b2=0.999, eps=1e-6, weight_decay=0.0)


def test_tensors_sharing_memory_or_atens_default_kernels_get_the_foreach_form(monkeypatch):
    flat = torch.zeros(10)
    apart, overlapping = [flat[:5], flat[5:]], [flat[:6], flat[4:]]
    assert adam_step.takes(apart, [torch.zeros(5), torch.zeros(5)]) == ROUNDS_AS_ATEN
    assert not adam_step.takes(overlapping)
    assert not adam_step.takes([flat, torch.zeros(3), flat])  # a tied weight listed twice
    assert not adam_step.takes([flat], [flat[2:3]])  # a gradient inside its parameter
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    assert not adam_step.takes(apart)

    # a tied weight in two modules: torch lists it twice in a group (with a warning); the foreach form updates
    # it twice in turn, and so does the optimiser here, whatever the kernel could take
    monkeypatch.undo()
    shared = nn.Parameter(torch.tensor([1.0, -2.0]))
    results = []
    for fused in (False, True):
        p = nn.Parameter(shared.detach().clone())
        with pytest.warns(UserWarning, match="duplicate"):
            opt = BertAdam([p, p], lr=0.1, weight_decay=0.01, fused=fused)
        p.grad = torch.tensor([0.5, -1.0])
        opt.step()
        results.append(p.detach().clone())
    assert torch.equal(results[0], results[1])
