"""``budget.time_limit_s``: trials the time limit cuts are not ASHA's early stops. Their runs end KILLED
with the reason, they count as unfinished, the parent says how many trials started, and a resume is
refused (Tune keeps the budget left: none)."""

from __future__ import annotations

from types import SimpleNamespace

import mlflow
import pytest

from prvrlab.platform.cli import main
from prvrlab.platform.search.mlflow_callback import MlflowStudyCallback
from prvrlab.platform.search.outcome import TIME_LIMIT, RunMap
from prvrlab.platform.search.study import TIME_LIMIT_META
from prvrlab.platform.search.time_limit import TimeLimit

from search_helpers import recorded_study, stand_in_study, study_runs, tiny_spec


@pytest.fixture(autouse=True)
def _clear():
    TIME_LIMIT.clear()
    yield
    TIME_LIMIT.clear()


def test_the_stopper_says_it_stopped_the_search():
    limit = TimeLimit(0.0)
    assert limit.stop_all() and TIME_LIMIT.is_set()
    TIME_LIMIT.clear()
    assert not TimeLimit(3600.0).stop_all() and not TIME_LIMIT.is_set()


@pytest.mark.parametrize("reached", [True, False])
def test_a_cut_trial_ends_killed_and_an_asha_stop_finished(tmp_path, reached):
    study, runs = stand_in_study(tmp_path, "limit", ["t"])
    study.time_limit_s = 20.0
    callback = MlflowStudyCallback(study)
    callback._open.add("t")
    if reached:
        TIME_LIMIT.set()
    trial = SimpleNamespace(trial_id="t", config={}, status="TERMINATED", metric_analysis={},
                            last_result={"kind": "epoch", "epoch": 1, "val/sumr": 10.0})
    callback._complete(trial)
    run = mlflow.MlflowClient(study.tracking_uri).get_run(runs["t"])
    if reached:
        assert run.info.status == "KILLED"
        assert run.data.tags["prvrlab.stop_reason"] == "budget.time_limit_s (20 s) ran out"
        assert run.data.tags["prvrlab.status"] == "time_limited"
        assert RunMap(study.study_dir).closed == {"t": "KILLED"}  # counted as unfinished (killed_trials)
        assert callback.cut == {"t"}  # its reports still compete for the best trial
    else:
        assert run.info.status == "FINISHED" and run.data.tags["prvrlab.status"] == "early_stopped"
        assert callback.cut == set()


def test_a_resume_of_a_search_the_time_limit_ended_is_refused(tmp_path, tiny_root, capsys):
    path, _, study_dir = recorded_study(tmp_path, tiny_root, "ended")
    runs = RunMap(study_dir)
    runs.meta[TIME_LIMIT_META] = 20.0
    runs.save()
    assert main(["search", str(path), "--check", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "ended when its budget.time_limit_s (20 s) ran out" in err and "without --resume" in err


@pytest.mark.slow
def test_a_time_limited_search_reports_its_cut_and_unstarted_trials(tiny_root, tmp_path, capsys):
    import ray

    path = tiny_spec(tmp_path, tiny_root, name="limited", budget={"trials": 20, "time_limit_s": 12},
                     sampler={"type": "random", "seed": 0})
    try:
        assert main(["search", str(path)]) in (0, 1)
    finally:
        ray.shutdown()
    out = capsys.readouterr().out
    (parent,), children = study_runs(tmp_path)
    reason = parent.data.tags["prvrlab.stop_reason"]
    assert reason.startswith("budget.time_limit_s (12 s) ran out: ") and reason.endswith(" of 20 trials started")
    started = int(reason.split(": ")[1].split(" of ")[0])
    assert 1 <= started < 20 and len(children) == started
    assert parent.data.metrics["trials/early_stopped"] == 0  # no scheduler: nothing stopped early
    assert sum(r.info.status == "KILLED" for r in children) == parent.data.metrics["trials/unfinished"]
    killed = [r for r in children if r.info.status == "KILLED" and "best/val/sumr" in r.data.metrics]
    if killed and parent.data.metrics["trials/finished"] == 0:  # a cut trial's reports still give a best trial
        assert parent.info.status == "FINISHED" and parent.data.tags["prvrlab.best_run"] in {r.info.run_id for r in killed}
    assert all(r.data.tags["prvrlab.stop_reason"] == "budget.time_limit_s (12 s) ran out"
               for r in children if r.info.status == "KILLED")
    assert f"search 'limited': {reason}" in out
    assert main(["search", str(path), "--resume"]) == 2


def test_a_trial_that_never_reported_is_unfinished():
    from prvrlab.platform.search.study import count_outcomes

    queued = SimpleNamespace(trial_id="q", status="TERMINATED", last_result={})  # stopped while still pending
    stopped = SimpleNamespace(trial_id="s", status="TERMINATED", last_result={"kind": "epoch", "epoch": 1})
    assert count_outcomes([queued, stopped]) == {"finished": 0, "early_stopped": 1, "failed": 0, "unfinished": 1}
