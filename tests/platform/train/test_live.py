"""The live in-epoch progress: the line's content, its throttling (fake clock), and a real in-process run."""

from __future__ import annotations

import io
import re

import pytest
from train_helpers import small_raw

from prvrlab.platform.config import validate
from prvrlab.platform.train.live import EpochTicker, FileProgress, LiveLine, format_progress, read_progress, short_progress


class FakeClock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def state(epoch=1, batch=1, batches=4, loss=1.0, rate=2.0, eta=1.5, epochs=3):
    return {"epoch": epoch, "epochs": epochs, "batch": batch, "batches": batches, "loss": loss, "rate": rate, "eta_s": eta}


def test_ticker_measures_rate_and_eta_from_its_clock():
    clock, seen = FakeClock(), []
    ticker = EpochTicker(epoch=1, epochs=5, total=10, emit=seen.append, clock=clock)
    for done in range(1, 5):
        clock.t += 0.5  # one batch every 0.5 s: 2 batches/s
        ticker.step(mean_loss=lambda done=done: 1.0 / done)
    last = seen[-1]
    assert len(seen) == 4 and last["batch"] == 4 and last["batches"] == 10
    assert last["rate"] == pytest.approx(2.0)
    assert last["eta_s"] == pytest.approx((10 - 4) / 2.0)
    assert last["loss"] == pytest.approx(0.25) and last["epoch"] == 1 and last["epochs"] == 5


def test_ticker_reads_the_running_loss_at_most_every_loss_every_s_and_at_the_last_batch():
    """Each read waits for the device on a GPU: batches 0.1 s apart, a read every 0.25 s."""
    clock, seen, reads = FakeClock(), [], []

    def mean_loss() -> float:
        reads.append(ticker.done)
        return float(ticker.done)

    ticker = EpochTicker(epoch=1, epochs=1, total=8, emit=seen.append, clock=clock, loss_every_s=0.25)
    for _ in range(8):
        clock.t += 0.1
        ticker.step(mean_loss)
    # read at t=0.1 (first), then once 0.25 s have passed: t=0.4 (batch 4), t=0.7 (batch 7), and the last batch
    assert reads == [1, 4, 7, 8]
    assert [s["loss"] for s in seen] == [1.0, 1.0, 1.0, 4.0, 4.0, 4.0, 7.0, 8.0]
    assert len(seen) == 8  # a state per batch all the same


def test_progress_line_format():
    line = format_progress(state(epoch=2, batch=37, batches=120, loss=0.84213, rate=1.94, eta=44.4, epochs=12))
    assert line == "epoch 2/12  batch 37/120   31%  loss 0.8421  1.94 batch/s  ETA 44s"
    assert format_progress(state(eta=3725)).endswith("ETA 1h02m")
    assert format_progress(state(eta=None)).endswith("ETA ?")
    assert short_progress(state(epoch=1, batch=3, batches=4, eta=75)) == "epoch 1/3 75% (ETA 1m15s)"


def test_plain_lines_every_n_seconds_without_carriage_returns():
    clock, out = FakeClock(), io.StringIO()
    live = LiveLine(out, tty=False, every_s=10.0, clock=clock)
    for batch in range(1, 31):  # one batch every 2 s: 60 s of epoch
        clock.t += 2.0
        live.update(state(batch=batch, batches=30))
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and "\033" not in out.getvalue()
    # the first state starts the epoch's clock (t=2); then a line at t=12, 22, ..., 52
    assert [int(re.search(r"batch (\d+)/", ln).group(1)) for ln in lines] == [6, 11, 16, 21, 26]
    live.clear()  # nothing to erase in a log file
    assert len(out.getvalue().splitlines()) == 5


def test_a_new_epoch_restarts_the_plain_line_clock():
    clock, out = FakeClock(), io.StringIO()
    live = LiveLine(out, tty=False, every_s=10.0, clock=clock)
    live.update(state(epoch=1, batch=1))
    clock.t += 11
    live.update(state(epoch=2, batch=1))  # new epoch: its first state only starts the clock
    assert out.getvalue() == ""
    clock.t += 10
    live.update(state(epoch=2, batch=2))
    assert out.getvalue().startswith("  epoch 2/3  batch 2/4")


def test_terminal_line_is_redrawn_in_place_at_most_four_times_a_second_and_cleared():
    clock, out = FakeClock(), io.StringIO()
    live = LiveLine(out, tty=True, clock=clock)
    for batch in range(1, 11):  # every 0.1 s
        clock.t += 0.1
        live.update(state(batch=batch, batches=10))
    draws = out.getvalue().split("\r")[1:]
    assert "\n" not in out.getvalue()
    assert [int(re.search(r"batch (\d+)/", d).group(1)) for d in draws] == [1, 4, 7, 10]
    assert all(d.endswith("\033[K") for d in draws)
    live.clear()
    assert out.getvalue().endswith("\r\033[K")
    clock.t += 1
    live.update(state(batch=10, batches=10))  # the same state again (a polled file): not redrawn
    assert out.getvalue().endswith("\r\033[K")


def test_progress_file_is_throttled_but_keeps_the_epochs_last_batch(tmp_path):
    clock = FakeClock()
    sink = FileProgress(tmp_path / "progress.json", every_s=1.0, clock=clock)
    sink(state(batch=1, batches=3))
    clock.t += 0.5
    sink(state(batch=2, batches=3))
    assert read_progress(tmp_path / "progress.json")["batch"] == 1
    sink(state(batch=3, batches=3))  # the last batch is always written
    assert read_progress(tmp_path / "progress.json")["batch"] == 3
    (tmp_path / "progress.json").write_text("{not json")
    assert read_progress(tmp_path / "progress.json") is None
    assert read_progress(tmp_path / "missing.json") is None


def test_in_process_training_prints_progress_lines_to_a_log(tiny_root, tmp_path, capsys, monkeypatch):
    from prvrlab.platform.train.driver import train
    from prvrlab.platform.tracking.store import Tracker

    monkeypatch.setenv("PRVRLAB_PROGRESS_S", "0")  # a line per batch
    raw = small_raw(tiny_root, tmp_path, epochs=2)
    train(validate(raw), use_ray=False, echo=print)
    out = capsys.readouterr().out  # captured: not a terminal
    assert "\r" not in out
    progress = re.findall(r"^  epoch (\d)/2  batch (\d+)/(\d+) .* loss (\S+) .* batch/s  ETA \S+$", out, re.M)
    batches = int(progress[0][2])
    assert [(int(e), int(b)) for e, b, _, _ in progress] == [(e, b) for e in (1, 2) for b in range(1, batches + 1)]
    epoch_lines = [i for i, ln in enumerate(out.splitlines()) if ln.startswith("epoch ")]
    assert len(epoch_lines) == 2  # each epoch line follows its progress lines
    # the run records its data collection as a dataset input
    tracker = Tracker(raw["tracking"]["uri"], raw["tracking"]["experiment"])
    (run,) = tracker.client.search_runs([tracker.experiment_id])
    (inp,) = run.inputs.dataset_inputs
    assert inp.dataset.name == "synth" and inp.dataset.source_type == "local"
    assert {t.key: t.value for t in inp.tags} == {"mlflow.data.context": "training"}
