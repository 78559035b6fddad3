"""``compare`` given a study's parent run says what it is (it had said the run "logged no final metrics")."""

from __future__ import annotations

import pytest

from prvrlab.platform.tracking.store import Tracker
from prvrlab.reports.compare import compare_runs
from prvrlab.reports.errors import ReportError


@pytest.mark.parametrize("kind", ["search", "ablation"])
def test_a_study_parent_is_named_as_one(tmp_path, kind):
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    tracker = Tracker(uri, "tests")
    parent = tracker.start_run("study", tags={"prvrlab.kind": kind})
    trial = tracker.start_run("trial", tags={"prvrlab.kind": "trial"}, parent_run_id=parent)
    tracker.log_metrics(trial, {f"final/val/{m}": 1.0 for m in ("r1", "r5", "r10", "r100", "sumr")})
    for run in (trial, parent):
        tracker.end_run(run, "FINISHED")
    with pytest.raises(ReportError) as caught:
        compare_runs(uri, [trial, parent], split="val")
    assert str(caught.value) == (f"run '{parent}' is the parent run of a {kind}, not a training run; compare its "
                                 f"trials' runs, or write its report: prvrlab report --run-id {parent}")
    other = tracker.start_run("plain", tags={})
    tracker.end_run(other, "FINISHED")
    with pytest.raises(ReportError, match=f"run '{other}' logged no final val metrics"):
        compare_runs(uri, [trial, other], split="val")
