"""Logged distributions (run artifacts ``distributions/<component>.<name>.json``) in the ablation report.

A fake study is written straight into a fresh tracking store: two variants of two seeds, one of which
carries a distribution artifact per run (the record format of ``histogram_record``)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from prvrlab.platform.tracking.store import Tracker
from prvrlab.reports.report import Options, write_report
from prvrlab.reports.source import load_study

from report_helpers import md_rows

OPT = Options(n_boot=20, seed=0)
FINAL = {"r1": 1.0, "r5": 5.0, "r10": 10.0, "r100": 50.0, "sumr": 66.0}
EDGES = [0.0, 0.25, 0.5, 0.75, 1.0]
# seed -> series -> (counts, mean of the values)
LOGGED = {
    0: {"positive": ([0, 0, 2, 2], 0.6), "unpaired": ([3, 1, 0, 0], 0.2)},
    1: {"positive": ([0, 1, 1, 2], 0.55), "unpaired": ([4, 0, 0, 0], 0.1)},
}


def record(seed: int) -> dict:
    series = {name: {"counts": c, "n": sum(c), "mean": m, "std": 0.1} for name, (c, m) in LOGGED[seed].items()}
    return {"component": "probe", "name": "score", "epoch": 3, "edges": EDGES, "series": series}


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("distributions")
    tracker = Tracker(f"sqlite:///{tmp / 'mlflow.db'}", "tests")
    parent = tracker.start_run("abl", tags={"prvrlab.kind": "ablation", "prvrlab.study": "abl"})
    tracker.log_params(parent, {"spec.baseline": "base", "spec.seeds": "[0, 1]", "variant.base": "{}", "variant.probe": "{}"})
    for variant in ("base", "probe"):
        for seed in (0, 1):
            tags = {"prvrlab.kind": "trial", "prvrlab.status": "finished", "prvrlab.variant": variant, "prvrlab.seed": str(seed)}
            run = tracker.start_run(f"abl/{variant}/seed{seed}", tags=tags, parent_run_id=parent)
            tracker.log_metrics(run, {f"final/val/{m}": v for m, v in FINAL.items()})
            if variant == "probe":
                path = tmp / f"{variant}{seed}" / "probe.score.json"
                path.parent.mkdir()
                path.write_text(json.dumps(record(seed)))
                tracker.log_artifacts(run, [path], "distributions")
            tracker.end_run(run, "FINISHED")
    tracker.end_run(parent, "FINISHED")
    return load_study(f"sqlite:///{tmp / 'mlflow.db'}", parent)


def quantile_by_hand(counts: list[int], q: float) -> float:
    """Walk the bins until q * n values are passed; linear inside that bin."""
    target, seen = q * sum(counts), 0
    for i, c in enumerate(counts):
        if c and seen + c >= target:
            return EDGES[i] + 0.25 * (target - seen) / c
        seen += c
    raise AssertionError


def test_report_renders_the_merged_distributions_per_variant(study, tmp_path):
    md = write_report(study, tmp_path, OPT).read_text()
    rows = md_rows(md, "### `probe.score`")
    assert rows[0] == ["Variant", "Series", "n", "Mean", "q10", "q50", "q90", "Epoch"]
    body = {(r[0], r[1]): r[2:] for r in rows[2:]}
    assert {v for v, _ in body} == {"probe"}  # the baseline's runs carry no artifact
    for name in ("positive", "unpaired"):
        counts = [a + b for a, b in zip(LOGGED[0][name][0], LOGGED[1][name][0])]
        n0, n1 = sum(LOGGED[0][name][0]), sum(LOGGED[1][name][0])
        mean = (LOGGED[0][name][1] * n0 + LOGGED[1][name][1] * n1) / (n0 + n1)
        expected = [str(n0 + n1), f"{mean:.4g}", *(f"{quantile_by_hand(counts, q):.4g}" for q in (0.1, 0.5, 0.9)), "3"]
        assert body[("probe", name)] == expected
    assert (tmp_path / "distribution_probe.score.png").is_file() and "(distribution_probe.score.png)" in md


def test_no_section_without_distribution_artifacts(study, tmp_path):
    base_only = replace(study, runs=[r for r in study.runs if r.variant == "base"])
    md = write_report(base_only, tmp_path, OPT).read_text()
    assert "## Ablation" in md and "## Distributions" not in md
