"""After a resume the best-so-far counts each restored trial's best report, not its last one (the line said
212.10 while the best before the kill was 217.74)."""

from __future__ import annotations

from types import SimpleNamespace

from prvrlab.platform.search.progress import ProgressCallback


def _restored(trial_id: str, last: float, best: float, worst: float):
    return SimpleNamespace(
        trial_id=trial_id, status="RUNNING", config={"train.lr": 1e-3}, last_result={"kind": "epoch", "val/sumr": last},
        metric_analysis={"val/sumr": {"max": best, "min": worst, "avg": (best + worst) / 2, "last": last}},
    )


def test_a_restored_trials_best_report_counts(capsys):
    view = ProgressCallback("val/sumr", "max", 2, lambda c: "")
    restored = _restored("t_00000", last=212.10, best=217.74, worst=150.0)
    fresh = SimpleNamespace(trial_id="t_00001", status="RUNNING", config={"train.lr": 2e-3}, last_result={})
    view.on_trial_result(0, [restored, fresh], fresh, {"kind": "epoch", "epoch": 1, "val/sumr": 100.0})
    assert "best val/sumr 217.74 (t_00000)" in capsys.readouterr().out
    view = ProgressCallback("val/sumr", "min", 2, lambda c: "")  # a metric to minimise: its lowest report
    view.on_trial_result(0, [restored, fresh], fresh, {"kind": "epoch", "epoch": 1, "val/sumr": 160.0})
    assert "best val/sumr 150.00 (t_00000)" in capsys.readouterr().out


def test_a_trial_without_the_summary_keeps_its_last_report(capsys):
    view = ProgressCallback("val/sumr", "max", 2, lambda c: "")
    restored = SimpleNamespace(trial_id="t_00000", status="TERMINATED", config={}, last_result={"kind": "final", "val/sumr": 190.0})
    fresh = SimpleNamespace(trial_id="t_00001", status="RUNNING", config={}, last_result={})
    view.on_trial_result(0, [restored, fresh], fresh, {"kind": "epoch", "epoch": 1, "val/sumr": 180.0})
    assert "best val/sumr 190.00 (t_00000)" in capsys.readouterr().out
