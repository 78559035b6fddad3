"""A trial ended by an interrupt is neither early-stopped nor a best config (issue 11, item 9)."""

from __future__ import annotations

from types import SimpleNamespace

from prvrlab.platform.search.study import StudyContext, count_outcomes
from prvrlab.platform.search.tuning import best_trial


def _trial(trial_id: str, value: float) -> SimpleNamespace:
    return SimpleNamespace(
        trial_id=trial_id,
        status="TERMINATED",
        last_result={"kind": "epoch", "val/sumr": value},
        metric_analysis={"val/sumr": {"max": value}},
        config={"train.lr": 1e-3},
    )


def test_killed_trial_is_unfinished_and_never_best(tmp_path):
    study = StudyContext(
        kind="search", name="s", study_dir=str(tmp_path), base_raw={}, metric="val/sumr", mode="max",
        workers=1, cpus_per_worker=1.0, gpus_per_worker=0.0, tracking_uri="", experiment="tests",
    )
    stopped, killed = _trial("a", 10.0), _trial("b", 50.0)
    counts = count_outcomes([stopped, killed], killed={"b"})
    assert counts == {"finished": 0, "early_stopped": 1, "failed": 0, "unfinished": 1}
    assert best_trial([stopped, killed], study, killed={"b"})["trial_id"] == "a"
    assert best_trial([killed], study, killed={"b"}) is None
