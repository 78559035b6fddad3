"""The final round reuses the best epoch's own validation instead of encoding the validation split again.

Its figures must equal a plain evaluation of the best checkpoint (what the
final round computed before), and the split is encoded once per epoch only.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

import prvrlab.evaluation.retrieval as retrieval
from prvrlab.evaluation.metrics import load_ranks
from prvrlab.platform.config import validate
from prvrlab.platform.train.checkpoint_eval import evaluate_checkpoint
from prvrlab.platform.train.loop import run_local

from train_helpers import small_raw


@pytest.fixture
def counted(monkeypatch) -> Counter:
    """How many times each split is evaluated (the real evaluation still runs)."""
    calls: Counter = Counter()
    real = retrieval.evaluate

    def evaluate(model, collection, split, *args, **kwargs):
        calls[split] += 1
        return real(model, collection, split, *args, **kwargs)

    monkeypatch.setattr(retrieval, "evaluate", evaluate)
    return calls


def test_final_validation_is_the_best_epochs_and_equals_a_plain_evaluation_of_the_best_checkpoint(tiny_root, tmp_path, counted):
    epochs = 3
    session = run_local(validate(small_raw(tiny_root, tmp_path, epochs=epochs)), tmp_path / "run")
    reports = [r for r in session.reports if r.get("kind") == "epoch"]
    (final,) = [r for r in session.reports if r.get("kind") == "final"]
    assert counted == Counter({"val": epochs, "test": 1})  # no second encoding of val in the final round

    best = reports[final["best/epoch"] - 1]
    assert best["val/sumr"] == final["best/sumr"]
    for key in ("r1", "r5", "r10", "r100", "sumr"):
        assert final[f"val/{key}"] == best[f"val/{key}"]

    counted.clear()
    plain = evaluate_checkpoint(tmp_path / "run" / "best_model.pt", split="val")
    assert counted == Counter({"val": 1})
    for key, value in plain.flat("val/").items():
        assert final[key] == pytest.approx(value, abs=1e-5), key
    written = load_ranks(tmp_path / "run" / "ranks_val.parquet")
    np.testing.assert_array_equal(written.column("rank").to_numpy(), plain.ranks)


def test_validation_from_before_a_restore_is_not_reused(tiny_root, tmp_path, counted):
    """A resumed attempt did not run the best epoch's validation itself, so the final round encodes val again."""
    cfg = validate(small_raw(tiny_root, tmp_path, epochs=2))
    first = run_local(cfg, tmp_path / "run")
    (final,) = [r for r in first.reports if r.get("kind") == "final"]
    counted.clear()
    resumed = run_local(cfg, tmp_path / "run")  # the local session restores the last checkpoint: no epoch left
    (again,) = [r for r in resumed.reports if r.get("kind") == "final"]
    assert counted["val"] == 1 and counted["test"] == 1
    for key in ("val/r1", "val/sumr", "test/sumr"):
        assert again[key] == pytest.approx(final[key], abs=1e-5)
