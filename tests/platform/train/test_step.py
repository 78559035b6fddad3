"""One training step: a non-finite loss (checked once per step, after the backward pass) changes no
weight and stops every rank at the same step; per-step scalars are summed where they live."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import seam_components  # noqa: F401  (registers test_nan_on_rank)
from prvrlab.platform.train.loop import MetricSums

from device_under_test import DEVICE, as_a_program
from train_helpers import gloo_group, rank_loop, small_raw


def nan_raw(root: Path, tmp: Path, *, rank: int, from_step: int, use_gpu: bool = False) -> dict:
    raw = small_raw(root, tmp, batch_size=8, epochs=1, torch_threads=1, use_gpu=use_gpu)
    raw["losses"]["broken"] = {"loss": "test_nan_on_rank", "weight": 1.0, "rank": rank, "from_step": from_step}
    return raw


def steps_until_failure(raw: dict, tmp: Path, *, rank: int = 0, world: int = 1, steps: int = 3) -> dict:
    """Run ``steps`` steps of epoch 0; the messages, and the weights/optimiser/schedule before and after the last."""
    loop = rank_loop(raw, tmp, rank=rank, world=world)
    loop.setup()
    model = loop.wrap()
    model.train()
    initial = {k: v.clone() for k, v in loop.system.state_dict().items()}
    sums, batches, messages = MetricSums(), iter(loop.loader), []
    for step in range(steps):
        if step == steps - 1:
            before = {k: v.clone() for k, v in loop.system.state_dict().items()}
            optimizer, schedule, global_step = copy.deepcopy(loop.optimizer.state_dict()), loop.scheduler.last_epoch, loop.global_step
        messages.append(loop.step(model, next(batches), 0, step, sums))
    after = loop.system.state_dict()
    return {
        "messages": messages,
        "trained": any(not torch.equal(initial[k], before[k]) for k in initial),
        "unchanged": all(torch.equal(before[k], after[k]) for k in before),
        "optimizer_unchanged": _same(optimizer, loop.optimizer.state_dict()),
        "schedule_unchanged": schedule == loop.scheduler.last_epoch and global_step == loop.global_step,
        "counts": dict(sums.counts),
        "weights": [float(v.double().sum()) for v in after.values() if v.is_floating_point()],
    }


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_a_non_finite_step_changes_no_weight_and_names_the_term(tiny_root, tmp_path):
    raw = nan_raw(tiny_root, tmp_path, rank=-1, from_step=2, use_gpu=DEVICE.type == "cuda")  # on the device under test
    with as_a_program():
        got = steps_until_failure(raw, tmp_path)
    assert got["messages"][:2] == ["", ""] and got["trained"]  # two real steps moved the weights
    assert got["messages"][2].startswith("non-finite loss at epoch 1: term(s) broken (broken=nan)")
    assert got["unchanged"] and got["optimizer_unchanged"] and got["schedule_unchanged"]
    assert got["counts"]["loss"] == 2  # the failed step's loss is not summed


def _rank(rank: int, world: int, init_file: str, raw: dict, out_dir: str) -> None:
    with gloo_group(rank, world, init_file):
        got = steps_until_failure(raw, Path(out_dir), rank=rank, world=world)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(got))


@pytest.mark.slow
def test_a_non_finite_loss_on_one_rank_stops_both_at_the_same_step(tiny_root, tmp_path):
    raw = nan_raw(tiny_root, tmp_path, rank=1, from_step=2)
    raw["train"]["num_workers"] = 2
    mp.spawn(_rank, args=(2, str(tmp_path / "init"), raw, str(tmp_path)), nprocs=2, join=True)
    zero, one = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert zero["messages"] == ["", "", "non-finite loss at epoch 1 on another worker"]
    assert one["messages"][:2] == ["", ""] and one["messages"][2].startswith("non-finite loss at epoch 1: term(s) broken")
    for got in (zero, one):
        assert got["trained"] and got["unchanged"] and got["optimizer_unchanged"] and got["schedule_unchanged"]
    assert zero["weights"] == one["weights"]  # DDP kept the ranks equal, the failed step included


def _unused_rank(rank: int, world: int, init_file: str, raw: dict, out_dir: str) -> None:
    with gloo_group(rank, world, init_file):
        loop = rank_loop(raw, Path(out_dir), rank=rank, world=world)
        loop.setup()
        model = loop.wrap()
        model.train()
        initial = {k: v.clone() for k, v in loop.system.state_dict().items()}
        sums, batches = MetricSums(), iter(loop.loader)
        messages = [loop.step(model, next(batches), 0, step, sums) for step in range(3)]
        after = loop.system.state_dict()
        moved = sorted(k for k in initial if not torch.equal(initial[k], after[k]))
        grads = {n: p.grad is None for n, p in loop.system.named_parameters()}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps({
            "messages": messages, "probe": loop.ddp_unused, "search": model.find_unused_parameters, "moved": moved, "no_grad": sorted(n for n, none in grads.items() if none),
            "weights": [float(v.double().sum()) for v in after.values() if v.is_floating_point()],
        }))


@pytest.mark.slow
def test_ddp_trains_a_configuration_that_leaves_parameters_unused(tiny_root, tmp_path):
    """RAL's CSA replaces GMMFormer's frame scores, so the frame branch's pooling takes no part in a step;
    DDP (which refuses such a second step unless told to look for unused parameters) trains on, the unused
    parameter keeps its value and no gradient, as on one rank, and the ranks stay equal."""
    raw = small_raw(tiny_root, tmp_path, batch_size=8, epochs=1, torch_threads=1, num_workers=2)
    raw["plugins"] = {"ral": {"msra": False}}
    mp.spawn(_unused_rank, args=(2, str(tmp_path / "init"), raw, str(tmp_path)), nprocs=2, join=True)
    zero, one = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    plain = small_raw(tiny_root, tmp_path / "plain", batch_size=8, epochs=1, torch_threads=1, num_workers=2)
    mp.spawn(_unused_rank, args=(2, str(tmp_path / "plain_init"), plain, str(tmp_path / "plain")), nprocs=2, join=True)
    for rank in range(2):  # nothing to find: DDP does not search (no walk per step, no warning)
        got = json.loads((tmp_path / "plain" / f"rank{rank}.json").read_text())
        assert got["probe"] == [] and not got["search"] and got["no_grad"] == [] and got["messages"] == ["", "", ""]
    unused = "model.backbone.frame.pool.score.weight"
    for got in (zero, one):
        assert got["messages"] == ["", "", ""]
        assert got["probe"] == [unused] and got["search"]
        assert got["no_grad"] == [unused] and unused not in got["moved"]
        assert any(k.startswith("model.backbone.frame.") for k in got["moved"])  # the rest of the branch trains
        assert any(k.startswith("model.plugins.ral.") for k in got["moved"])
    assert zero["weights"] == one["weights"]


def test_tensor_values_sum_to_the_same_means_as_their_floats():
    values = [torch.tensor(v, dtype=torch.float32) for v in (0.1, 0.7, 1e-8, 3.3)]
    as_tensors, as_floats = MetricSums(), MetricSums()
    for v in values:
        as_tensors.add("loss", v)
        as_floats.add("loss", float(v))
    as_tensors.add("only_float", 2.0)
    assert isinstance(as_tensors.sums["loss"], torch.Tensor)  # stays a tensor: no read per step
    assert as_tensors.means() == as_floats.means() | {"only_float": 2.0}
    assert as_tensors.mean_loss() == sum(float(v) for v in values) / 4
