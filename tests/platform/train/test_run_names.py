"""Runs started in the same second get folders of their own (they had shared one: files, checkpoints and
final metrics mixed between the two runs)."""

from __future__ import annotations

import threading

from prvrlab.platform.train import driver
from prvrlab.platform.train.driver import claim_run_name

from train_helpers import small_raw


def _cfg(tiny_root, tmp_path):
    from prvrlab.platform.config import validate

    return validate(small_raw(tiny_root, tmp_path, epochs=1))


def test_same_second_runs_get_their_own_folders(tiny_root, tmp_path, monkeypatch):
    cfg = _cfg(tiny_root, tmp_path)
    monkeypatch.setattr(driver.time, "strftime", lambda fmt, *a: "20261207-073213")  # one second for all
    names = [claim_run_name(cfg) for _ in range(3)]
    base = f"{cfg.name}-20261207-073213"
    assert names == [base, f"{base}-2", f"{base}-3"]
    assert all((tmp_path / "results" / n).is_dir() for n in names)  # small_raw's tracking.storage_path


def test_concurrent_claims_never_share_a_name(tiny_root, tmp_path, monkeypatch):
    cfg = _cfg(tiny_root, tmp_path)
    monkeypatch.setattr(driver.time, "strftime", lambda fmt, *a: "20261207-073213")
    names, start = [], threading.Barrier(8)

    def claim():
        start.wait()
        names.append(claim_run_name(cfg))

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(names) == 8 and len(set(names)) == 8
