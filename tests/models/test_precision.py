"""kept_casts / weight_cast: inside an encoding loop the fused paths cast each weight to autocast's dtype once,
not once per batch, and the embeddings are the same bit for bit."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from prvrlab.evaluation import retrieval as ev
from prvrlab.models.base import tensors_of
from prvrlab.models import blocks
from prvrlab.models.blocks import BranchLinear, branch_mlp, project
from prvrlab.models.precision import kept_casts, weight_cast
from test_backbones import NAMES, build, make_batch
from device_under_test import DEVICE


CASTS = (torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype, torch.ops.aten.to.dtype_layout)


class CastCounter(TorchDispatchMode):
    """Counts the casts (``aten.to`` / ``aten._to_copy``) whose input is one of the ``watched`` tensors."""

    def __init__(self, watched) -> None:
        super().__init__()
        self.watched = [t for t in watched]
        self.count = 0
        self.elements: list[int] = []  # how many values each counted cast read

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in CASTS and any(_within(args[0], t) for t in self.watched):
            self.count += 1
            self.elements.append(args[0].numel())
        return func(*args, **(kwargs or {}))


def _within(x: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether ``x`` starts inside ``t``'s storage (``t`` itself or a slice of it)."""
    start = t.data_ptr()
    return start <= x.data_ptr() < start + t.numel() * t.element_size()


def test_weight_cast_is_made_once_per_parameter_version():
    p = nn.Parameter(torch.randn(4, 3, device=DEVICE))
    low = torch.bfloat16
    with torch.no_grad():
        outside = weight_cast(p, low)
        assert torch.equal(outside, p.to(low)) and weight_cast(p, low) is not outside  # nothing kept outside
        with kept_casts(DEVICE.type):
            first = weight_cast(p, low)
            assert torch.equal(first, outside) and weight_cast(p, low) is first
            p.mul_(3)  # a changed parameter is cast again
            second = weight_cast(p, low)
            assert second is not first and torch.equal(second, p.to(low))
            plain = torch.randn(2, device=DEVICE)  # not a parameter: never kept
            assert weight_cast(plain, low) is not weight_cast(plain, low)
            assert weight_cast(p, torch.float32) is p  # already that dtype
            with torch.enable_grad():  # with autograd the cast must stay in the graph
                assert weight_cast(p, low) is not second
        assert weight_cast(p, low) is not second  # let go on exit


def test_branch_mlp_casts_its_weights_once_inside_kept_casts():
    first = BranchLinear(num_branches=3, in_dim=8, out_dim=16).to(DEVICE)
    second = BranchLinear(num_branches=3, in_dim=16, out_dim=8).to(DEVICE)
    weights = [first.weight, first.bias, second.weight, second.bias]
    x = torch.randn(3, 5, 8, device=DEVICE)

    def run(kept: bool):
        counter = CastCounter(weights)
        with torch.inference_mode(), counter, kept_casts(enabled=kept):
            outs = []
            for _ in range(3):  # one autocast block per batch, as an encoding loop
                with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
                    outs.append(branch_mlp(x, first, second))
        return counter.count, outs

    plain_casts, plain = run(False)
    kept_count, kept = run(True)
    assert (plain_casts, kept_count) == (12, 4)
    assert all(torch.equal(a, b) for a, b in zip(plain, kept))
    assert kept[0].dtype == torch.bfloat16


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the fused Q/K/V projection is a CPU path")
def test_project_casts_its_weights_once_inside_kept_casts():
    layer = nn.Linear(8, 12)
    x = torch.randn(5, 8)

    def run(kept: bool):
        counter = CastCounter([layer.weight, layer.bias])
        with torch.inference_mode(), counter, kept_casts(enabled=kept):
            outs = []
            for _ in range(3):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    outs.append(project(layer, x, parts=3))
        return counter.count, outs

    plain_casts, plain = run(False)
    kept_count, kept = run(True)
    if not blocks._fused_linear(torch.bfloat16):  # no oneDNN fused bf16 op here: autocast's F.linear casts, per batch
        assert kept_count == plain_casts
    else:
        assert (plain_casts, kept_count) == (6, 2)  # weight and bias in every batch / once
    for a, b in zip(plain, kept):
        assert all(torch.equal(u, v) for u, v in zip(a, b))


def video_batches(lengths_per_batch):
    batches = []
    for i, lengths in enumerate(lengths_per_batch):
        b = make_batch(lengths, [2], [0], seed=i)
        ids = [f"b{i}v{j}" for j in range(len(lengths))]
        batches.append((ids, b.clips, b.frames, b.frame_mask))
    return batches


@pytest.mark.parametrize("name", NAMES)
def test_encoding_with_kept_casts_gives_the_same_embeddings(name, monkeypatch):
    torch.manual_seed(0)
    model = build(name).to(DEVICE)
    batches = video_batches([[7, 5, 2], [6, 6, 1], [4, 3, 3]])
    b = make_batch([3], [5, 2, 7, 3, 4, 1], [0] * 6, seed=9)
    queries = [([f"q{i}" for i in range(3)], b.queries[:3], b.query_mask[:3]),
               ([f"q{i}" for i in range(3, 6)], b.queries[3:], b.query_mask[3:])]

    def encode():
        video, _ = ev.encode_videos(model, batches, device=DEVICE, amp_dtype="bf16")
        query, _ = ev.encode_queries(model, queries, device=DEVICE, amp_dtype="bf16")
        return tensors_of(video) + tensors_of(query)

    kept = encode()
    with monkeypatch.context() as m:
        m.setattr(ev, "kept_casts", lambda enabled=True: contextlib.nullcontext())  # the plain path
        plain = encode()
    assert len(kept) == len(plain)
    for i, (a, b) in enumerate(zip(kept, plain)):
        assert torch.equal(a, b), f"tensor {i} of the embeddings"


def test_a_training_step_over_one_branch_casts_only_its_weights():
    first = BranchLinear(num_branches=4, in_dim=8, out_dim=16).to(DEVICE)
    second = BranchLinear(num_branches=4, in_dim=16, out_dim=8).to(DEVICE)
    x = torch.randn(1, 5, 8, device=DEVICE)
    counter = CastCounter([first.weight, first.bias, second.weight, second.bias])
    with counter, torch.autocast(DEVICE.type, dtype=torch.bfloat16):  # autograd on, as a checkpointed branch
        out = branch_mlp(x, first, second, slice(2, 3))
    assert counter.elements == [16 * 8, 16, 8 * 16, 8]  # branch 2's weights and biases, not all 4 branches'
    want = torch.relu(x[0].bfloat16() @ first.weight[2].bfloat16().t() + first.bias[2].bfloat16())
    want = want @ second.weight[2].bfloat16().t() + second.bias[2].bfloat16()
    torch.testing.assert_close(out[0].float(), want.float(), atol=2e-2, rtol=2e-2)
