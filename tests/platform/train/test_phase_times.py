"""Per-trial phase times the search overhead profile reads: ``time/setup_s`` on an attempt's first epoch
(setup + restore + DDP wrap), ``time/final_s`` on the final round (best-model evaluation)."""

from __future__ import annotations

import time

from prvrlab.platform.config import validate
from prvrlab.platform.train.loop import run_local

from train_helpers import small_raw


def test_setup_time_on_the_first_epoch_only_and_final_time_on_the_final_round(tiny_root, tmp_path):
    t0 = time.perf_counter()
    session = run_local(validate(small_raw(tiny_root, tmp_path, epochs=2)), tmp_path / "run")
    wall = time.perf_counter() - t0
    epochs = [r for r in session.reports if r.get("kind") == "epoch"]
    (final,) = [r for r in session.reports if r.get("kind") == "final"]
    assert [("time/setup_s" in e) for e in epochs] == [True, False]
    assert "time/setup_s" not in final and "time/final_s" in final and "time/final_s" not in epochs[0]
    phases = epochs[0]["time/setup_s"] + sum(e["time/epoch_s"] for e in epochs) + final["time/final_s"]
    assert 0 < epochs[0]["time/setup_s"] and 0 < final["time/final_s"] and phases <= wall  # disjoint parts of the run
