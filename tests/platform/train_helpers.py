"""Config builders shared by the training tests."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path


def untrained_val_sumr(raw: dict) -> float:
    """Validation SumR of the config's model, seeded as training seeds it, before any training step."""
    import torch

    from prvrlab.data.collection import open_collection
    from prvrlab.evaluation.retrieval import evaluate
    from prvrlab.models.factory import build_model
    from prvrlab.platform.config import validate
    from prvrlab.platform.train.loop import seed_everything

    cfg = validate(raw)
    seed_everything(cfg.train.seed)
    collection = open_collection(cfg.data)
    model = build_model(cfg.model, cfg.plugins, video_dim=collection.video_dim, query_dim=collection.query_dim)
    return evaluate(model, collection, "val", cfg.eval, device=torch.device("cpu")).metrics["sumr"]


def val_sumr_by_epoch(raw: dict, run_dir: Path) -> list[float]:
    """Train ``raw`` in this process (no MLflow) and return each epoch's validation SumR."""
    from prvrlab.platform.config import validate
    from prvrlab.platform.train.loop import run_local

    session = run_local(validate(raw), run_dir)
    return [r["val/sumr"] for r in session.reports if r.get("kind") == "epoch"]


def small_raw(root: Path, tmp: Path, **train) -> dict:
    """A fast GMMFormer config on the tiny synthetic collection."""
    return {
        "name": "tiny",
        "data": {"root": str(root), "collection": "synth", "visual_feature": "synth_feat"},
        "model": {"name": "gmmformer", "hidden_size": 32, "num_heads": 2, "dropout": 0.0},
        "losses": {
            "clip_triplet": {"loss": "triplet", "weight": 1.0, "branch": "clip", "margin": 0.2},
            "frame_triplet": {"loss": "triplet", "weight": 1.0, "branch": "frame", "margin": 0.2},
            "clip_nce": {"loss": "infonce", "weight": 0.05, "branch": "clip"},
            "frame_nce": {"loss": "infonce", "weight": 0.05, "branch": "frame"},
            "query_diverse": {"loss": "query_diverse", "weight": 0.003, "branch": "clip"},
        },
        "train": {"epochs": 8, "batch_size": 16, "lr": 1e-3, "num_workers": 1, "seed": 0, **train},
        "eval": {"final_splits": ["val", "test"]},
        "tracking": {"uri": f"sqlite:///{tmp / 'mlflow.db'}", "experiment": "tests", "storage_path": str(tmp / "results")},
    }


def truly_relevant_by_hand(truth: dict, query_id: str, video_id: str) -> bool:
    """Reading of a ``*.truth.json`` by hand: a moment of the video shows everything the query names."""
    action, obj = truth["queries"][query_id]
    return any(
        (action is None or action == a) and (obj is None or obj == o) for a, o in truth["videos"][video_id]
    )


def rank_loop(raw: dict, out_dir: Path, *, rank: int, world: int):
    """A TrainingLoop of ``raw`` for DDP rank ``rank`` of ``world`` (a local session in ``out_dir``); the
    caller has joined the process group."""
    from prvrlab.platform.config import validate
    from prvrlab.platform.train.loop import TrainingLoop
    from prvrlab.platform.train.session import LocalSession

    session = LocalSession(Path(out_dir) / f"session{rank}")
    session.rank, session.world_size = rank, world
    return TrainingLoop(validate(raw), session=session, run_dir=Path(out_dir) / "run")


@contextmanager
def gloo_group(rank: int, world: int, init_file: str):
    """A gloo process group for one spawned test rank. After the body, the ranks meet at a barrier before
    any closes its connections, so neither tears down while the other still works (the likely cause of a
    rank's SIGABRT seen once in a loaded full suite; not reproduced since)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        yield
        dist.barrier()
    finally:
        dist.destroy_process_group()


def check_a_format_7_model(root: Path, tmp: Path, backbone: str, old: dict, official: dict) -> None:
    """A ``backbone`` model trained with the switches ``old`` saved as a format-7 file, whose stored config
    lacks the keys format 8 added (resolved today to ``official``): evaluated as it was trained; the same
    weights claimed as format 8 are refused ("weights do not fit"), not half-loaded."""
    import pytest
    import torch

    from prvrlab.data.collection import open_collection
    from prvrlab.evaluation.retrieval import evaluate
    from prvrlab.models.factory import build_model
    from prvrlab.platform.config import validate
    from prvrlab.platform.train.checkpoint_eval import evaluate_checkpoint

    raw = dict(small_raw(root, tmp), plugins={})
    raw["model"] = {"name": backbone, "hidden_size": 32, "num_heads": 2}
    raw["losses"] = {"clip_nce": {"loss": "infonce", "weight": 1.0, "branch": "clip"}}
    trained = validate({**raw, "model": {**raw["model"], **old}})
    collection = open_collection(trained.data)
    torch.manual_seed(0)
    model = build_model(trained.model, trained.plugins, video_dim=collection.video_dim, query_dim=collection.query_dim)
    stored = validate(raw).to_dict()
    for key, value in official.items():
        assert stored["model"][key] == value  # the resolved defaults are the official behaviour
        del stored["model"][key]  # the keys did not exist before format 8
    for fmt, name in ((7, "old.pt"), (8, "new.pt")):
        torch.save({"model": model.state_dict(), "config": stored, "epoch": 1, "format": fmt}, tmp / name)
    expected = evaluate(model, collection, "val", trained.eval, device=torch.device("cpu")).ranks
    assert (evaluate_checkpoint(tmp / "old.pt", split="val").ranks == expected).all()
    with pytest.raises(Exception, match="weights do not fit"):
        evaluate_checkpoint(tmp / "new.pt", split="val")
