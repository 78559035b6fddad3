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


def recorded_study(tmp: Path, tiny_root: Path, name: str, **fields):
    """A search spec ``name`` and a fake earlier submission folder of it whose Tune state this user's driver
    recorded (what ``--resume`` continues): (spec path, spec, study folder)."""
    from prvrlab.platform.search.outcome import RunMap
    from prvrlab.platform.search.spec import load_search_spec
    from prvrlab.platform.search.study import record_state, spec_hash, study_root

    path = tiny_spec(tmp, tiny_root, name=name, **fields)
    spec = load_search_spec(path)
    study_dir = study_root(tmp / "results", "search", name) / "20250101-000000"
    (study_dir / "tune").mkdir(parents=True)
    (study_dir / "tune" / "experiment_state-1.json").write_text("{}")
    runs = RunMap(study_dir)
    runs.meta["spec_hash"] = spec_hash(spec)
    runs.save()
    record_state(study_dir)
    return path, spec, study_dir


def stand_in_study(tmp: Path, experiment: str, trial_ids, closed: dict[str, str] | None = None):
    """A stand-in for a study's context (local storage) with a parent run and an open child run per trial,
    mapped in its ``study.json`` as Tune's start leaves them; returns (study, {trial id: run id})."""
    import json
    from types import SimpleNamespace

    from prvrlab.platform.search.outcome import STUDY_FILE
    from prvrlab.platform.storage import Mirror

    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    folder = tmp / "study"
    folder.mkdir()
    study = SimpleNamespace(
        study_dir=str(folder), tracking_uri=uri, experiment=experiment, trial_dir=lambda t: folder / "trials" / t / "files",
        storage="", push_files=lambda: Mirror(folder, None),  # local storage: nothing pushed
    )
    tracker = Tracker(uri, experiment)
    parent = tracker.start_run("search")
    runs = {t: tracker.start_run(f"trial {t}", parent_run_id=parent) for t in trial_ids}
    (folder / STUDY_FILE).write_text(json.dumps({"parent": parent, "trials": runs, "closed": closed or {}}))
    return study, runs
