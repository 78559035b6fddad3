"""A run records what it trained with beside its config: ``run/ranks`` (DDP ranks that trained) and
``run/threads`` (each rank's torch threads) at every epoch, e.g. ``--no-ray`` trains one rank
whatever ``train.num_workers`` says, and the thread count decides float sums' order."""

from __future__ import annotations

import torch

from prvrlab.platform.config import validate
from prvrlab.platform.train.loop import run_local

from train_helpers import small_raw


def test_the_first_epoch_records_the_ranks_and_threads_that_trained(tiny_root, tmp_path):
    cfg = validate(small_raw(tiny_root, tmp_path, epochs=2, num_workers=2, torch_threads=2))
    session = run_local(cfg, tmp_path / "run")
    epochs = [r for r in session.reports if r.get("kind") == "epoch"]
    for epoch in epochs:  # every epoch (a resumed attempt's too, so its reports equal the uninterrupted run's)
        assert (epoch["run/ranks"], epoch["run/threads"]) == (1, 2)  # one rank in-process, as configured threads
    assert cfg.train.num_workers == 2 and torch.get_num_threads() == 2


def test_the_first_epoch_records_whether_the_cpu_kernels_drew_the_dropout_masks(tiny_root, tmp_path, monkeypatch):
    from prvrlab.models import random_bits

    with_kernels = run_local(validate(small_raw(tiny_root, tmp_path, epochs=1)), tmp_path / "a")
    assert with_kernels.reports[0]["run/native_kernels"] == int(random_bits.load() is not None)
    monkeypatch.setattr(random_bits, "load", lambda: None)  # a machine without a compiler
    without = run_local(validate(small_raw(tiny_root, tmp_path, epochs=1)), tmp_path / "b")
    assert without.reports[0]["run/native_kernels"] == 0
