"""The best model a run reports is the one in best_model.pt, whatever point an attempt died at.

best_model.pt is written when an epoch validates best, before that epoch's checkpoint is saved (a reused
pool's session saves it later still). A retry resumed from an earlier checkpoint takes the file's epoch and
SumR as its best: the weights of the best the checkpoint knew are gone. The validation SumRs are scripted,
so which epoch is best does not depend on training.
"""

from __future__ import annotations

import pytest
import torch

import prvrlab.evaluation.retrieval as retrieval
from prvrlab.platform.config import validate
from prvrlab.platform.train.checkpoint_eval import evaluate_checkpoint
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


def saved(tmp_path) -> tuple[int, float]:
    blob = torch.load(tmp_path / "run" / "best_model.pt", map_location="cpu", weights_only=True)
    return blob["epoch"], blob["val_sumr"]


def test_a_best_whose_checkpoint_was_never_saved_is_the_runs_best_on_the_retry(tiny_root, tmp_path, scripted, capsys):
    cfg = validate(small_raw(tiny_root, tmp_path, epochs=3))
    scripted([10.0, 20.0])  # epoch 2 is a new best, and the attempt dies before its checkpoint is kept
    assert attempt(cfg, tmp_path, DyingSession(tmp_path / "session", die_at=2)) is None
    assert saved(tmp_path) == (2, 20.0)  # epoch 1's weights are gone
    scripted([5.0, 5.0])  # the retry trains epochs 2 and 3 again, both worse
    final = attempt(cfg, tmp_path, DyingSession(tmp_path / "session"))
    assert "best_model.pt holds epoch 2 (val SumR 20.00), not the checkpoint's best epoch 1" in capsys.readouterr().err
    assert (final["best/epoch"], final["best/sumr"]) == saved(tmp_path) == (2, 20.0)
    plain = evaluate_checkpoint(tmp_path / "run" / "best_model.pt", split="val")
    # the final round evaluates the file's weights (not the retried epoch 2's validation, scripted to 5)
    assert final["val/sumr"] == pytest.approx(plain.metrics["sumr"], abs=1e-5)


def test_a_best_whose_checkpoint_was_saved_is_kept_as_it_is(tiny_root, tmp_path, scripted, capsys):
    cfg = validate(small_raw(tiny_root, tmp_path, epochs=3))
    scripted([10.0, 20.0])
    assert attempt(cfg, tmp_path, DyingSession(tmp_path / "session", die_at=2, after_checkpoint=True)) is None
    scripted([5.0])
    final = attempt(cfg, tmp_path, DyingSession(tmp_path / "session"))
    assert "best_model.pt holds" not in capsys.readouterr().err
    assert (final["best/epoch"], final["best/sumr"]) == saved(tmp_path) == (2, 20.0)


def test_a_missing_best_model_stops_the_final_round_instead_of_reporting_the_last_weights(tiny_root, tmp_path, monkeypatch):
    cfg = validate(small_raw(tiny_root, tmp_path, epochs=1))
    report = TrainingLoop.report

    def report_then_lose_the_file(self, epoch, *args, **kwargs):
        report(self, epoch, *args, **kwargs)
        self.best_path.unlink()  # a retry on another node, or a cleaned folder

    monkeypatch.setattr(TrainingLoop, "report", report_then_lose_the_file)
    with pytest.raises(RuntimeError, match="best_model.pt is missing"):
        TrainingLoop(cfg, session=LocalSession(tmp_path / "session"), run_dir=tmp_path / "run").run()
