"""Component metrics (``train/<component>.<name>``) in the ablation and search reports, checked against MLflow.

The studies are written straight into a fresh tracking store (no Ray, no training): a parent run and child
runs with the tags, final metrics and per-epoch histories the platform logs.
"""

from __future__ import annotations

import statistics

import pytest
from mlflow.tracking import MlflowClient

from prvrlab.platform.tracking.store import Tracker
from prvrlab.reports.report import Options, write_report
from prvrlab.reports.source import load_study

from report_helpers import md_rows

OPT = Options(n_boot=50, seed=0)
FINAL = {"r1": 1.0, "r5": 5.0, "r10": 10.0, "r100": 50.0, "sumr": 66.0}


def _child(tracker: Tracker, parent: str, name: str, tags: dict, params: dict, histories: dict, bump: float) -> str:
    run = tracker.start_run(name, tags={"prvrlab.kind": "trial", "prvrlab.status": "finished", **tags}, parent_run_id=parent)
    tracker.log_params(run, params)
    for epoch in range(3):
        tracker.log_metrics(run, {key: fn(epoch) for key, fn in histories.items()}, step=epoch)
    tracker.log_metrics(run, {f"final/val/{m}": v + bump for m, v in FINAL.items()})
    tracker.end_run(run, "FINISHED")
    return run


def _histories(scale: float, with_ral: bool) -> dict:
    out = {"train/loss": lambda e: 1.0 / (e + 1), "train/clip_nce": lambda e: 0.5 / (e + 1), "val/sumr": lambda e: 60.0 + e * scale}
    if with_ral:
        out["train/ral.sigma_query"] = lambda e: 0.1 * scale + 0.01 * e
        out["train/ral.sigma_video"] = lambda e: -0.2 * scale / (e + 1)
    return out


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    uri = f"sqlite:///{tmp_path_factory.mktemp('component_metrics') / 'mlflow.db'}"
    tracker = Tracker(uri, "tests")
    abl = tracker.start_run("abl", tags={"prvrlab.kind": "ablation", "prvrlab.study": "abl"})
    tracker.log_params(abl, {"spec.baseline": "base", "spec.seeds": "[0, 1]", "variant.base": "{}", "variant.ral": "{}"})
    for seed in (0, 1):
        tags = {"prvrlab.variant": "base", "prvrlab.seed": str(seed), "components": "backbone:gmmformer"}
        _child(tracker, abl, f"abl/base/seed{seed}", tags, {"train.seed": seed}, _histories(1.0 + seed, False), seed)
        tags = {"prvrlab.variant": "ral", "prvrlab.seed": str(seed), "components": "backbone:gmmformer,plugin:ral"}
        _child(tracker, abl, f"abl/ral/seed{seed}", tags, {"train.seed": seed}, _histories(2.0 + 3 * seed, True), seed + 1)
    tracker.end_run(abl, "FINISHED")

    srch = tracker.start_run("srch", tags={"prvrlab.kind": "search", "prvrlab.study": "srch"})
    tracker.log_params(srch, {"spec.metric": "val/sumr", "spec.mode": "max", "space.train.lr": "{'loguniform': [0.0001, 0.01]}"})
    for i, lr in enumerate((1e-4, 1e-3, 1e-2)):
        tags = {"prvrlab.trial_id": f"t{i}"}
        _child(tracker, srch, f"srch/t{i}", tags, {"train.lr": lr}, _histories(1.0 + i, i != 1), i)
    tracker.end_run(srch, "FINISHED")
    return uri, abl, srch


def _last_epoch(client: MlflowClient, run_id: str, key: str) -> float | None:
    """The value logged at the highest step (the last epoch), read from the full history."""
    history = client.get_metric_history(run_id, key)
    if not history:
        return None
    return max(history, key=lambda m: (m.step, m.timestamp)).value


def _expected(uri: str, parent: str, group_tag: str) -> tuple[list[str], dict[str, dict[str, list[float]]]]:
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_run(parent).info.experiment_id
    children = client.search_runs([exp], filter_string=f"tags.`mlflow.parentRunId` = '{parent}'")
    keys = sorted({k[len("train/") :] for c in children for k in c.data.metrics if k.startswith("train/") and "." in k})
    values: dict[str, dict[str, list[float]]] = {}
    for c in children:
        for key in keys:
            value = _last_epoch(client, c.info.run_id, f"train/{key}")
            if value is not None:
                values.setdefault(c.data.tags[group_tag], {}).setdefault(key, []).append(value)
    return keys, values


def test_ablation_report_shows_component_metrics(store, tmp_path):
    uri, abl, _ = store
    keys, values = _expected(uri, abl, "prvrlab.variant")
    assert keys == ["ral.sigma_query", "ral.sigma_video"]  # loss terms (no dot) are not component metrics
    md = write_report(load_study(uri, abl), tmp_path / "a", OPT).read_text()
    rows = md_rows(md, "## Component metrics (last epoch)")
    assert rows[0] == ["Variant", *(f"`{k}`" for k in keys)]
    body = {r[0]: r[1:] for r in rows[2:]}
    assert body["base (baseline)"] == ["—", "—"]
    for i, key in enumerate(keys):
        xs = values["ral"][key]
        assert len(xs) == 2
        assert body["ral"][i] == f"{statistics.fmean(xs):.4g} ± {statistics.stdev(xs):.2g}"


def test_search_report_shows_component_metrics_per_trial(store, tmp_path):
    uri, _, srch = store
    keys, values = _expected(uri, srch, "prvrlab.trial_id")
    out = tmp_path / "s"
    md = write_report(load_study(uri, srch), out, OPT).read_text()
    rows = md_rows(md, "## Component metrics (last epoch)")
    assert rows[0] == ["Trial", *(f"`{k}`" for k in keys)]
    expected = []
    for trial in ("t2", "t1", "t0"):  # ranked by final/val/sumr, best first
        expected.append([f"`{trial}`", *(f"{values[trial][k][0]:.4g}" if trial in values else "—" for k in keys)])
    assert rows[2:] == expected
    for key in keys:
        assert (out / f"component_{key}.png").is_file() and f"(component_{key}.png)" in md


def test_component_report_is_byte_identical_and_absent_without_component_metrics(store, tmp_path):
    uri, abl, srch = store
    for parent in (abl, srch):
        a = write_report(load_study(uri, parent), tmp_path / f"{parent}a", OPT).read_bytes()
        b = write_report(load_study(uri, parent), tmp_path / f"{parent}b", OPT).read_bytes()
        assert a == b
    tracker = Tracker(uri, "tests")
    plain = tracker.start_run("plain", tags={"prvrlab.kind": "ablation", "prvrlab.study": "plain"})
    _child(tracker, plain, "plain/base/seed0", {"prvrlab.variant": "base", "prvrlab.seed": "0"}, {}, _histories(1.0, False), 0)
    tracker.end_run(plain, "FINISHED")
    md = write_report(load_study(uri, plain), tmp_path / "plain", OPT).read_text()
    assert "## Ablation (val)" in md and "Component metrics" not in md
