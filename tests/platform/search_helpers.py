"""Helpers shared by the search, ablation and job-submit tests."""

from __future__ import annotations

from pathlib import Path

import yaml

from prvrlab.platform.tracking.store import Tracker

REPO = Path(__file__).resolve().parents[2]
TINY_OVERRIDES = {
    "model.hidden_size": 32,
    "model.num_heads": 2,
    "model.dropout": 0.0,
    "train.epochs": 2,
    "train.batch_size": 16,
    "eval.final_splits": ["val"],
}


def tiny_spec(tmp: Path, tiny_root: Path, name: str = "tiny", overrides: dict | None = None, **fields) -> Path:
    """A search (or, with ``variants``, ablation) spec on the tiny collection, tracked under ``tmp``
    (``overrides``: more of the spec's config overrides)."""
    spec = {
        "name": name,
        "base_config": str(REPO / "configs" / "gmmformer_synth.yaml"),
        "overrides": {
            **TINY_OVERRIDES,
            "data.root": str(tiny_root),
            "data.synthesize": None,
            "tracking.uri": f"sqlite:///{tmp / 'mlflow.db'}",
            "tracking.storage_path": str(tmp / "results"),
            "tracking.experiment": "tests",
            **(overrides or {}),
        },
        "concurrency": 1,
        "resources": {"workers_per_trial": 1},
        "max_retries": 1,
    }
    if "variants" not in fields:
        spec.update({"budget": {"trials": 3}, "sampler": {"type": "tpe", "seed": 0}, "space": {"train.lr": {"loguniform": [3e-4, 3e-3]}}})
    spec.update(fields)
    sampled = [k for k, v in (spec.get("space") or {}).items() if isinstance(v, dict) and "when" not in v]
    for key in sampled:  # a key every trial samples takes no override (the spec would be refused)
        spec["overrides"].pop(key, None)
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def study_runs(tmp: Path):
    """(parents, children) MLflow runs of the test experiment under ``tmp``."""
    tracker = Tracker(f"sqlite:///{tmp / 'mlflow.db'}", "tests")
    runs = tracker.client.search_runs([tracker.experiment_id], max_results=1000)
    parents = [r for r in runs if r.data.tags.get("prvrlab.kind") in ("search", "ablation")]
    children = [r for r in runs if r.data.tags.get("prvrlab.kind") == "trial"]
    return parents, children


def metric_history(tmp: Path, run_id: str, key: str):
    tracker = Tracker(f"sqlite:///{tmp / 'mlflow.db'}", "tests")
    return tracker.client.get_metric_history(run_id, key)
