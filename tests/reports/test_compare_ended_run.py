"""compare against a run that ended without its final metrics says how it ended (killed, failed), not only that
it logged none."""

from __future__ import annotations

import pytest

from prvrlab.platform.tracking.store import Tracker
from prvrlab.reports.compare import compare_runs
from prvrlab.reports.errors import ReportError

METRICS = ("r1", "r5", "r10", "r100", "sumr")


@pytest.mark.parametrize("status, tag, said", [
    ("KILLED", None, "(it ended KILLED, status killed)"),
    ("FAILED", "error", "(it ended FAILED, status error)"),
    ("FINISHED", None, ""),
    ("RUNNING", None, "(it is still RUNNING)"),
])
def test_a_run_without_final_metrics_is_named_with_how_it_ended(tmp_path, status, tag, said):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker(uri, "tests")
    done = tracker.start_run("done", tags={})
    tracker.log_metrics(done, {f"final/val/{m}": 1.0 for m in METRICS})
    tracker.end_run(done, "FINISHED")
    cut = tracker.start_run("cut", tags={"prvrlab.status": tag} if tag else {})
    tracker.log_metrics(cut, {"val/sumr": 3.0}, step=1)
    if status != "RUNNING":
        tracker.end_run(cut, status)
    with pytest.raises(ReportError) as caught:
        compare_runs(uri, [done, cut], split="val", n_boot=20)
    assert str(caught.value).startswith(f"run '{cut}'{' ' + said if said else ''} logged no final val metrics (final/val/sumr)")
