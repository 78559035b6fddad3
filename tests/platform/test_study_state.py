"""The run sentinel's record of a killed driver's Tune state (prvrlab/platform/study_state.py: record_settled)."""

from __future__ import annotations

import threading
import time

from prvrlab.platform.study_state import read_sums, record_settled, state_record, state_sums


def test_a_study_is_recorded_only_after_it_stays_unchanged_for_the_quiet_time(tmp_path, monkeypatch):
    """A killed driver's trial can still write a checkpoint a moment later, after a pause between reports: a
    record taken at the first two equal readings missed it, and the next --resume refused the study."""
    monkeypatch.setenv("PRVRLAB_CACHE_DIR", str(tmp_path / "cache"))
    study = tmp_path / "study"
    (study / "tune" / "trial_1").mkdir(parents=True)
    (study / "tune" / "experiment_state.json").write_text("{}")
    late = study / "tune" / "trial_1" / "checkpoint_000000" / "state.pt"

    def trial_still_alive() -> None:  # quiet for 0.35 s (several readings), then its checkpoint
        time.sleep(0.35)
        late.parent.mkdir()
        late.write_bytes(b"weights")

    writer = threading.Thread(target=trial_still_alive)
    start = time.monotonic()
    writer.start()
    try:
        assert record_settled(study, settle_s=0.1, quiet_s=0.8, timeout_s=10.0)
    finally:
        writer.join()
    assert time.monotonic() - start >= 0.35 + 0.8  # quiet counted from the last change
    recorded = read_sums(state_record(study))
    assert recorded == state_sums(study) and "tune/trial_1/checkpoint_000000/state.pt" in recorded


def test_a_study_that_keeps_changing_is_not_recorded(tmp_path, monkeypatch):
    monkeypatch.setenv("PRVRLAB_CACHE_DIR", str(tmp_path / "cache"))
    study = tmp_path / "study"
    (study / "tune").mkdir(parents=True)
    stop = threading.Event()

    def busy() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            (study / "tune" / "experiment_state.json").write_text(str(n))
            time.sleep(0.05)

    writer = threading.Thread(target=busy)
    writer.start()
    try:
        assert not record_settled(study, settle_s=0.1, quiet_s=0.3, timeout_s=1.0)
    finally:
        stop.set()
        writer.join()
    assert not state_record(study).exists()
