"""The winners kernel (prvrlab/models/winners.py) against torch.argmax of the same quotients, special values
and ties included, and max_scores with it against max_scores without it."""

from __future__ import annotations

import pytest
import torch

from prvrlab.models import scoring
from prvrlab.models import winners as wk

pytestmark = pytest.mark.skipif(wk.load() is None, reason="no C++ compiler to build the kernel")

NAN, INF, LOWEST = float("nan"), float("inf"), torch.finfo(torch.float32).min


def argmax_winners(dots, q_norm, v_norm, pad, with_logits):
    """The winners as PyTorch finds them (max_scores' passes without the kernel): (Nq, C, 1 or 2)."""
    cos = dots / (q_norm[:, None, None] * v_norm[None])
    raw = dots
    if pad is not None:
        cos = cos.masked_fill(pad, -INF)
        raw = dots.masked_fill(pad, LOWEST)
    found = [cos.argmax(dim=-1)] + ([raw.argmax(dim=-1)] if with_logits else [])
    return torch.stack(found, dim=-1)


def case(nq, c, length, seed, levels=None):
    gen = torch.Generator().manual_seed(seed)
    if levels is None:
        dots = torch.randn(nq, c, length, generator=gen)
        q_norm = torch.rand(nq, generator=gen) + 0.5
        v_norm = torch.rand(c, length, generator=gen) + 0.5
    else:  # few distinct values and unit norms: many exact ties
        dots = torch.randint(-levels, levels + 1, (nq, c, length), generator=gen).float()
        q_norm, v_norm = torch.ones(nq), torch.ones(c, length)
    lengths = torch.randint(0, length + 1, (c,), generator=gen)
    lengths[0] = length  # one video without padding; lengths of 0 give videos without a real vector
    pad = ~(torch.arange(length)[None] < lengths[:, None])[None]  # (1, C, L)
    return dots, q_norm, v_norm, pad


@pytest.mark.parametrize("with_logits", [True, False])
@pytest.mark.parametrize("levels", [None, 2])
def test_winners_equal_torch_argmax_with_padding_and_ties(with_logits, levels):
    dots, q_norm, v_norm, pad = case(37, 23, 45, seed=3, levels=levels)
    for mask in (pad, None):
        got = wk.winners(dots, q_norm, v_norm, mask, with_logits)
        want = argmax_winners(dots, q_norm, v_norm, mask, with_logits)
        assert got.dtype == torch.int64 and torch.equal(got, want)
    if levels is not None:  # the ties were there, and went to the first position
        assert (dots == dots.amax(dim=-1, keepdim=True)).sum(-1).gt(1).any()


def test_special_values_follow_torch_argmax():
    """The first NaN wins (torch.argmax's rule), +-inf order as numbers, -0.0 ties with 0.0 (the first wins),
    padding loses to every real value (the raw dot's padding ties with a real float32 minimum: the first
    wins), and a video without a real vector gives position 0."""
    rows = [
        [1.0, NAN, 3.0, NAN],
        [-INF, -INF, -INF, -INF],
        [-0.0, 0.0, -0.0, -1.0],
        [0.0, -0.0, -2.0, -3.0],
        [INF, 1.0, INF, NAN],
        [-1.0, -INF, LOWEST, 2.0],
        [LOWEST, LOWEST, -5.0, -INF],
    ]
    dots = torch.tensor(rows)[None]  # (1, 7, 4)
    q_norm, v_norm = torch.ones(1), torch.ones(7, 4)
    real = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1], [0, 1, 1, 1], [0, 0, 0, 1], [1, 1, 0, 0], [0, 1, 1, 1]])
    for pad in (~real.bool()[None], torch.ones(1, 7, 4, dtype=torch.bool), None):
        got = wk.winners(dots, q_norm, v_norm, pad, True)
        assert torch.equal(got, argmax_winners(dots, q_norm, v_norm, pad, True)), pad
    got = wk.winners(dots, q_norm, v_norm, None, True)[0]
    assert got[0].tolist() == [1, 1] and got[2].tolist() == [0, 0] and got[4].tolist() == [3, 3]
    assert wk.winners(dots, q_norm, v_norm, torch.ones(1, 7, 4, dtype=torch.bool), True).eq(0).all()


def test_quotients_are_rounded_as_atens():
    """Near ties decided by the last bit of the quotient: the denominators are products rounded before the
    division (not a reciprocal, not a fused multiply), as ATen rounds them."""
    gen = torch.Generator().manual_seed(5)
    base = torch.rand(64, 1, 1, generator=gen) + 0.5
    dots = base * (1 + torch.randint(-2, 3, (64, 9, 33), generator=gen) * 2**-23)  # values a few ulps apart
    q_norm = torch.rand(64, generator=gen) + 0.5
    v_norm = 1 + torch.randint(-3, 4, (9, 33), generator=gen) * 2**-23
    got = wk.winners(dots, q_norm, v_norm, None, False)
    assert torch.equal(got, argmax_winners(dots, q_norm, v_norm, None, False))


def test_thread_counts_give_the_same_winners():
    dots, q_norm, v_norm, pad = case(64, 40, 128, seed=7)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = wk.winners(dots, q_norm, v_norm, pad, True)
        torch.set_num_threads(2)
        two = wk.winners(dots, q_norm, v_norm, pad, True)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two) and torch.equal(one, argmax_winners(dots, q_norm, v_norm, pad, True))


def test_inputs_the_kernel_does_not_take_are_left_to_pytorch():
    dots, q_norm, v_norm, pad = case(4, 3, 5, seed=1)
    assert wk.winners(dots.double(), q_norm.double(), v_norm.double(), pad, True) is None
    assert wk.winners(dots[:, :, :0], q_norm, v_norm[:, :0], None, True) is None
    with pytest.raises(ValueError, match="norms"):
        wk.winners(dots, q_norm, v_norm.t(), pad, True)
    with pytest.raises(ValueError, match="padding mask"):
        wk.winners(dots, q_norm, v_norm, pad[0], True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_max_scores_with_the_kernel_equal_max_scores_without_it(monkeypatch, dtype):
    """Scores and gradients, bit for bit: the kernel only finds the winners."""
    gen = torch.Generator().manual_seed(11)
    query = torch.randn(9, 16, generator=gen).to(dtype)
    video = torch.randn(6, 12, 16, generator=gen).to(dtype)
    mask = torch.arange(12)[None] < torch.tensor([12, 5, 1, 0, 9, 12])[:, None]

    def run():
        q, v = query.clone().requires_grad_(), video.clone().requires_grad_()
        out = scoring.max_scores(q, v, mask, with_logits=True)
        (out.sim * torch.linspace(-1, 1, out.sim.numel()).view_as(out.sim)).sum().backward(retain_graph=True)
        out.logits.clamp(min=-1e3).sum().backward()
        return out.sim, out.logits, q.grad, v.grad

    calls = []
    kernel = wk.winners
    monkeypatch.setattr(wk, "winners", lambda *a: calls.append(1) or kernel(*a))
    fused = run()
    assert calls
    monkeypatch.setattr(wk, "winners", lambda *a: None)
    plain = run()
    for a, b in zip(fused, plain):
        assert torch.equal(a, b)
