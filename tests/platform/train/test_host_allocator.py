"""train.host_allocator and the caps on the caches of matrix products reach every process that computes: the
training loop and checkpoint evaluation."""

from __future__ import annotations

from prvrlab import allocator
from prvrlab.evaluation import retrieval
from prvrlab.platform.config import validate
from prvrlab.platform.train.checkpoint_eval import evaluate_checkpoint
from prvrlab.platform.train.loop import run_local

from train_helpers import small_raw


def test_training_and_checkpoint_evaluation_apply_the_configured_allocator(tiny_root, tmp_path, monkeypatch):
    applied: list[str] = []
    released: list[bool] = []
    monkeypatch.setattr(allocator, "set_host_allocator", lambda mode: applied.append(mode) or True)
    monkeypatch.setattr(retrieval, "release_free_memory", lambda: released.append(True) or True)
    cfg = validate(small_raw(tiny_root, tmp_path, epochs=1, host_allocator="system"))
    run_local(cfg, tmp_path / "run")
    assert applied and set(applied) == {"system"}  # each attempt's setup, before any tensor work
    assert not released  # training's evaluations keep the pages the next step reuses

    applied.clear()
    scored: list[tuple[int, int, bool]] = []  # (queries, chunk, release_memory) of each compute_ranks
    real_ranks = retrieval.compute_ranks
    monkeypatch.setattr(retrieval, "compute_ranks",
                        lambda *a, **k: scored.append((len(a[3]), k["chunk"], k["release_memory"])) or real_ranks(*a, **k))
    evaluate_checkpoint(tmp_path / "run" / "best_model.pt", split="val")
    assert applied == ["system"]
    # an evaluation alone: before the gallery is assembled, after the video and the query phase, after
    # indexing, and after every chunk of scored queries
    ((queries, chunk, release),) = scored
    assert release and released == [True] * (4 + -(-queries // chunk))


def test_the_default_is_keep(tiny_root, tmp_path):
    assert validate(small_raw(tiny_root, tmp_path)).train.host_allocator == "keep"


def test_training_caps_the_product_caches_and_checkpoint_evaluation_caps_them_lower(tiny_root, tmp_path, monkeypatch):
    """A training attempt caps oneDNN's and PyTorch's caches of matrix products at 64 each in its setup
    (before its first product); an evaluation-only process at 16 each."""
    import inspect

    defaults = inspect.signature(allocator.cap_primitive_caches).parameters
    assert (defaults["primitives"].default, defaults["computations"].default) == (
        allocator.TRAIN_PRIMITIVE_CACHE, allocator.TRAIN_COMPUTATION_CACHE) == (64, 64)
    calls: list[tuple] = []
    monkeypatch.setattr(allocator, "cap_primitive_caches", lambda *args: calls.append(args) or ())
    cfg = validate(small_raw(tiny_root, tmp_path, epochs=1))
    run_local(cfg, tmp_path / "run")
    assert calls and set(calls) == {()}  # the training defaults, each attempt
    calls.clear()
    evaluate_checkpoint(tmp_path / "run" / "best_model.pt", split="val")
    assert calls == [(allocator.EVAL_PRIMITIVE_CACHE, allocator.EVAL_COMPUTATION_CACHE)] == [(16, 16)]
