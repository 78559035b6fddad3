"""Training processes and checkpoint evaluation settle MKL's vector-math kernels (prvrlab/vector_math.py) before
their first batch."""

from __future__ import annotations

from prvrlab import vector_math
from prvrlab.data import dataset
from prvrlab.evaluation import retrieval
from prvrlab.platform.config import validate
from prvrlab.platform.train.checkpoint_eval import evaluate_checkpoint
from prvrlab.platform.train.loop import run_local

from train_helpers import small_raw


def test_training_and_checkpoint_evaluation_settle_the_vector_math_first(tiny_root, tmp_path, monkeypatch):
    events: list[str] = []
    monkeypatch.setattr(vector_math, "settle_vector_math", lambda: events.append("settle"))
    real_loader, real_evaluate = dataset.train_loader, retrieval.evaluate
    monkeypatch.setattr(dataset, "train_loader", lambda *a, **k: events.append("batches") or real_loader(*a, **k))
    monkeypatch.setattr(retrieval, "evaluate", lambda *a, **k: events.append("evaluate") or real_evaluate(*a, **k))
    run_local(validate(small_raw(tiny_root, tmp_path, epochs=1)), tmp_path / "run")
    assert events[:2] == ["settle", "batches"] and events.count("settle") == 1, events  # one attempt
    events.clear()
    evaluate_checkpoint(tmp_path / "run" / "best_model.pt", split="val")
    assert events == ["settle", "evaluate"]
