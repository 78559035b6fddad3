"""``prvrlab train --no-ray`` (:func:`run_local`) gives its one worker ``train.cpus_per_worker`` CPUs, as a
Ray worker has: torch threads = that rounded up (``train.torch_threads`` overrides; unset: 1)."""

from __future__ import annotations

import math

import pytest
import torch

from prvrlab.platform.config import validate
from prvrlab.platform.train.loop import run_local

from train_helpers import small_raw


@pytest.fixture
def threads_kept():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    "train",
    [{"cpus_per_worker": 2.0}, {"cpus_per_worker": 1.5}, {"cpus_per_worker": 3.0, "torch_threads": 2}, {}],
    ids=["two_cpus", "a_fraction_rounds_up", "torch_threads_overrides", "unset"],
)
def test_the_in_process_worker_uses_the_configured_cpus(tiny_root, tmp_path, threads_kept, train):
    cfg = validate(small_raw(tiny_root, tmp_path, epochs=1, **train))
    cpus = train.get("cpus_per_worker", 1.0)
    expected = train.get("torch_threads") or max(1, math.ceil(cpus))
    torch.set_num_threads(expected + 1)  # neither the expected count nor 1 before training
    seen: list[int] = []
    run_local(cfg, tmp_path / "run", on_report=lambda m: seen.append(torch.get_num_threads()))
    assert seen == [expected, expected]  # the epoch's report and the final one
