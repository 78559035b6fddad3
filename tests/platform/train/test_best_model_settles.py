"""best_model.pt always holds the epoch the run reports as best, whatever point an attempt died at.

A new best moves the one it replaces aside until its epoch's recovery checkpoint is reported; a retry
settles what a dead attempt left. The validation SumRs are scripted, so which epoch is
best does not depend on training.
"""

from __future__ import annotations

import pytest
import torch

import prvrlab.evaluation.retrieval as retrieval
from prvrlab.platform.config import validate
from prvrlab.platform.train.checkpoint_eval import evaluate_checkpoint
from prvrlab.platform.storage import PREV_BEST
from prvrlab.platform.train.loop import TrainingLoop
from prvrlab.platform.train.session import LocalSession

from train_helpers import small_raw


class Died(Exception):
    """The worker's death, raised from inside a report."""


class DyingSession(LocalSession):
    """Dies while reporting epoch ``die_at``: before its checkpoint is kept (``after_checkpoint`` False) or after."""

    def __init__(self, root, die_at=None, after_checkpoint=False):
        super().__init__(root)
        self.die_at, self.after_checkpoint = die_at, after_checkpoint

    def report(self, metrics, checkpoint_dir=None):
        dies = metrics.get("kind") == "epoch" and metrics["epoch"] == self.die_at
        if dies and not self.after_checkpoint:
            raise Died()
        super().report(metrics, checkpoint_dir)
        if dies:
            raise Died()


@pytest.fixture
def scripted(monkeypatch):
    """``scripted(values)``: the next validation SumRs are ``values`` in order (the real evaluation runs; later
    ones are real)."""
    real = retrieval.evaluate
    queue: list[float] = []

    def evaluate(model, collection, split, *args, **kwargs):
        result = real(model, collection, split, *args, **kwargs)
        if split == "val" and queue:
            result.metrics["sumr"] = queue.pop(0)
        return result

    monkeypatch.setattr(retrieval, "evaluate", evaluate)
    return lambda values: queue.extend(values)


def attempt(cfg, tmp_path, session):
    try:
        TrainingLoop(cfg, session=session, run_dir=tmp_path / "run").run()
    except Died:
        return None
    return session.reports[-1]


def saved_epoch(tmp_path) -> int:
    return torch.load(tmp_path / "run" / "best_model.pt", map_location="cpu", weights_only=True)["epoch"]


def test_a_best_whose_checkpoint_was_never_reported_does_not_replace_the_checkpoints_best(tiny_root, tmp_path, scripted):
    cfg = validate(small_raw(tiny_root, tmp_path, epochs=3))
    scripted([10.0, 20.0])  # epoch 2 is a new best, and the attempt dies reporting it
    assert attempt(cfg, tmp_path, DyingSession(tmp_path / "session", die_at=2)) is None
    assert saved_epoch(tmp_path) == 2 and (tmp_path / "run" / PREV_BEST).exists()  # epoch 1's, set aside
    scripted([5.0, 5.0])  # the retry trains epochs 2 and 3 again, both worse than epoch 1
    final = attempt(cfg, tmp_path, DyingSession(tmp_path / "session"))
    assert final["best/epoch"] == 1 and final["best/sumr"] == 10.0
    assert saved_epoch(tmp_path) == 1 and not (tmp_path / "run" / PREV_BEST).exists()
    plain = evaluate_checkpoint(tmp_path / "run" / "best_model.pt", split="val")
    assert final["val/sumr"] == pytest.approx(plain.metrics["sumr"], abs=1e-5)  # the reported best's own weights


def test_a_best_whose_checkpoint_was_reported_stays_when_the_attempt_ends_in_its_report(tiny_root, tmp_path, scripted):
    """Tune stops a trial (a scheduler's decision) inside the report of the epoch: nothing after it runs."""
    cfg = validate(small_raw(tiny_root, tmp_path, epochs=3))
    scripted([10.0, 20.0])
    assert attempt(cfg, tmp_path, DyingSession(tmp_path / "session", die_at=2, after_checkpoint=True)) is None
    assert saved_epoch(tmp_path) == 2  # what the trial's artifacts take when it was stopped here
    scripted([5.0])
    final = attempt(cfg, tmp_path, DyingSession(tmp_path / "session"))
    assert final["best/epoch"] == 2 and final["best/sumr"] == 20.0
    assert saved_epoch(tmp_path) == 2 and not (tmp_path / "run" / PREV_BEST).exists()


def test_a_missing_best_model_stops_the_final_round_instead_of_reporting_the_last_weights(tiny_root, tmp_path, monkeypatch):
    cfg = validate(small_raw(tiny_root, tmp_path, epochs=1))
    report = TrainingLoop.report

    def report_then_lose_the_file(self, epoch, *args, **kwargs):
        report(self, epoch, *args, **kwargs)
        self.best_path.unlink()  # a retry on another node, or a cleaned folder

    monkeypatch.setattr(TrainingLoop, "report", report_then_lose_the_file)
    with pytest.raises(RuntimeError, match="best_model.pt is missing"):
        TrainingLoop(cfg, session=LocalSession(tmp_path / "session"), run_dir=tmp_path / "run").run()
