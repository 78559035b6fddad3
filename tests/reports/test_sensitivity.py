"""The sensitivity table counts the runs its means are over."""

from __future__ import annotations

import statistics

from prvrlab.reports.report import Doc, sensitivity_section
from prvrlab.reports.source import TrialRun

from report_helpers import md_rows


def _trial(i: int, sumr: float | None) -> TrialRun:
    """A finished trial with final test metrics, or an early-stopped one without (sumr None)."""
    metrics = {} if sumr is None else {f"final/test/{m}": v for m, v in
                                       {"r1": 1.0, "r5": 2.0, "r10": 3.0, "r100": 100.0, "sumr": sumr}.items()}
    status = "early_stopped" if sumr is None else "finished"
    return TrialRun(f"r{i}", f"r{i}", "FINISHED", 0, {"prvrlab.status": status}, {}, metrics)


def test_runs_counts_only_the_runs_with_final_metrics(tmp_path):
    points = [(1, 150.0), (1, None), (1, None), (2, 140.0), (2, 141.0), (3, 120.0)]
    doc = Doc(tmp_path)
    sensitivity_section(doc, {"lr": [(lr, _trial(i, s)) for i, (lr, s) in enumerate(points)]}, {"lr": {"choice": [1, 2, 3]}}, "test")
    md = doc.text()
    body = {r[0]: r for r in md_rows(md, "**lr**")[2:]}
    assert {k: r[1] for k, r in body.items()} == {"1": "1 of 3", "2": "2", "3": "1"}
    assert body["2"][-1] == f"{statistics.fmean([140.0, 141.0]):.1f}" and body["1"][-1] == "150.0"
    assert "Runs: those with final test metrics, which the means are over (k of n: the other n − k runs" in md
