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


LATE_WRITER = """
import sys, time
from pathlib import Path
from prvrlab.platform.study_state import register_writer
study, driver = Path(sys.argv[1]), dict(zip(("prvrlab.driver_host", "prvrlab.driver_pid", "prvrlab.driver_start"), sys.argv[2:5]))
register_writer(study, driver)
print("registered", flush=True)
time.sleep(float(sys.argv[5]))
late = study / "tune" / "trial_1" / "checkpoint_000000" / "state.pt"
late.parent.mkdir(parents=True)
late.write_bytes(b"weights")
time.sleep(float(sys.argv[6]))
"""


def _writer(study, driver: dict[str, str], pause_s: float, linger_s: float = 0.0):
    """A process registered as ``driver``'s writer of ``study``: quiet for ``pause_s``, then a checkpoint."""
    import subprocess
    import sys

    from prvrlab.platform.tracking.drivers import HOST_TAG, PID_TAG, START_TAG

    proc = subprocess.Popen(
        [sys.executable, "-c", LATE_WRITER, str(study), driver[HOST_TAG], driver[PID_TAG], driver[START_TAG], str(pause_s), str(linger_s)],
        stdout=subprocess.PIPE, text=True,
    )
    assert proc.stdout.readline().strip() == "registered"
    return proc


def _study(tmp_path):
    study = tmp_path / "study"
    (study / "tune").mkdir(parents=True)
    (study / "tune" / "experiment_state.json").write_text("{}")
    return study


def test_a_killed_drivers_state_is_recorded_only_after_its_trial_processes_are_gone(tmp_path, monkeypatch):
    """A trial actor outlives its SIGKILLed driver until Ray stops it (~2 s here, longer on a loaded host)
    and may write a checkpoint after a pause longer than any quiet time: the sentinel waits for the process."""
    from prvrlab.platform.study_state import WRITERS
    from prvrlab.platform.tracking.drivers import driver_tags

    monkeypatch.setenv("PRVRLAB_CACHE_DIR", str(tmp_path / "cache"))
    study = _study(tmp_path)
    driver = driver_tags()  # stands for the dead driver: the registration names it
    writer = _writer(study, driver, pause_s=1.5)
    beats = []
    try:
        assert record_settled(study, driver=driver, settle_s=0.1, quiet_s=0.3, heartbeat=lambda: beats.append(1))
        assert writer.poll() is not None  # recorded only once the writer had exited
    finally:
        writer.kill()
        writer.wait()
    recorded = read_sums(state_record(study))
    assert recorded == state_sums(study) and "tune/trial_1/checkpoint_000000/state.pt" in recorded
    assert len(beats) >= 1.5 / 0.2  # the ledger kept fresh while waiting
    assert list((study / WRITERS).iterdir()) == []  # the gone writer's registration is removed


def test_writers_of_another_driver_are_not_waited_for(tmp_path, monkeypatch):
    from prvrlab.platform.study_state import WRITERS
    from prvrlab.platform.tracking.drivers import START_TAG, driver_tags

    monkeypatch.setenv("PRVRLAB_CACHE_DIR", str(tmp_path / "cache"))
    study = _study(tmp_path)
    driver = driver_tags()
    other = {**driver, START_TAG: str(int(driver[START_TAG]) + 1)}  # the same pid, another process
    writer = _writer(study, other, pause_s=30)
    try:
        start = time.monotonic()
        assert record_settled(study, driver=driver, settle_s=0.1, quiet_s=0.3, writers_timeout_s=20)
        assert time.monotonic() - start < 10
        assert len(list((study / WRITERS).iterdir())) == 1  # alive: its registration stays
    finally:
        writer.kill()
        writer.wait()
    assert "tune/trial_1/checkpoint_000000/state.pt" not in read_sums(state_record(study))


def test_a_writer_that_never_ends_delays_the_record_by_the_writers_timeout_only(tmp_path, monkeypatch):
    from prvrlab.platform.tracking.drivers import driver_tags

    monkeypatch.setenv("PRVRLAB_CACHE_DIR", str(tmp_path / "cache"))
    study = _study(tmp_path)
    driver = driver_tags()
    writer = _writer(study, driver, pause_s=0.2, linger_s=60)
    try:
        start = time.monotonic()
        assert record_settled(study, driver=driver, settle_s=0.1, quiet_s=0.3, writers_timeout_s=1.0)
        elapsed = time.monotonic() - start
        assert writer.poll() is None and 1.0 + 0.3 <= elapsed < 10
    finally:
        writer.kill()
        writer.wait()
    assert "tune/trial_1/checkpoint_000000/state.pt" in read_sums(state_record(study))
