"""A trial ``budget.time_limit_s`` cut (run KILLED, ``prvrlab.status: time_limited``) has usable reports, as
an ASHA early stop has: the report ranks it as the search did, and counts it under its own label; a trial
killed by an interrupt stays unusable."""

from __future__ import annotations

from prvrlab.reports.report import _counts_text, _status_counts
from prvrlab.reports.source import TrialRun


def _run(run_status: str, status: str) -> TrialRun:
    return TrialRun("r", "r", run_status, 0, {"prvrlab.status": status}, {}, {})


def test_a_time_limited_trial_is_usable_and_an_interrupted_one_is_not():
    assert _run("KILLED", "time_limited").ok
    assert not _run("KILLED", "killed").ok
    assert _run("FINISHED", "early_stopped").ok and not _run("FAILED", "error").ok


def test_the_counts_name_it():
    runs = [_run("FINISHED", "finished"), _run("KILLED", "time_limited"), _run("KILLED", "time_limited"), _run("KILLED", "killed")]
    assert _counts_text(_status_counts(runs)) == "1 finished, 2 time-limited, 1 killed"
