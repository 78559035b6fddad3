"""A run that fails on a full disk says so (a full disk surfaces as whatever the failed write raised, e.g.
torch.save's 'unexpected pos 181184 vs 181072')."""

from __future__ import annotations

from collections import namedtuple

import pytest

from prvrlab.platform import failures
from prvrlab.platform.config import validate
from prvrlab.platform.failures import LOW_DISK_BYTES, Failure, with_disk_note
from prvrlab.platform.train import loop
from prvrlab.platform.train.driver import TrainingError, train
from prvrlab.platform.tracking.store import Tracker

from train_helpers import small_raw

Usage = namedtuple("Usage", "total used free")


def test_the_note_names_the_full_disk_and_only_then(tmp_path, monkeypatch):
    failure = Failure("error", "error in the driver: RuntimeError: unexpected pos 181184 vs 181072", False)
    seen = []

    def usage(path, free):
        seen.append(path)
        return Usage(10**9, 10**9 - free, free)

    monkeypatch.setattr(failures.shutil, "disk_usage", lambda path: usage(path, 300 * 1024))
    noted = with_disk_note(failure, tmp_path / "run" / "files")  # not made yet: its nearest existing parent
    assert noted.summary == f"{failure.summary} (the disk holding {tmp_path / 'run' / 'files'} is full: 300 KiB free)"
    assert seen == [tmp_path] and (noted.kind, noted.retryable) == ("error", False)
    monkeypatch.setattr(failures.shutil, "disk_usage", lambda path: usage(path, LOW_DISK_BYTES))
    assert with_disk_note(failure, tmp_path) is failure


def test_a_run_failing_on_a_full_disk_says_so(tiny_root, tmp_path, monkeypatch):
    def full(cfg, run_dir, on_report=None, on_progress=None, sync_to=None):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 181184 vs 181072")

    monkeypatch.setattr(loop, "run_local", full)
    monkeypatch.setattr(failures.shutil, "disk_usage", lambda path: Usage(10**9, 10**9 - 4096, 4096))
    raw = small_raw(tiny_root, tmp_path)
    with pytest.raises(TrainingError, match=r"unexpected pos 181184 vs 181072 \(the disk holding .* is full: 4 KiB free\)"):
        train(validate(raw), use_ray=False, echo=None)
    tracker = Tracker(raw["tracking"]["uri"], raw["tracking"]["experiment"])
    (run,) = tracker.client.search_runs([tracker.experiment_id])
    assert run.info.status == "FAILED" and run.data.tags["error"].endswith("is full: 4 KiB free)")
