"""The search/ablation console view: the running trials' in-epoch progress line (fake trials and clock)."""

from __future__ import annotations

from types import SimpleNamespace

from prvrlab.platform.search.progress import ProgressCallback


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def trial(trial_id: str, status: str, lr: float):
    return SimpleNamespace(trial_id=trial_id, status=status, config={"train.lr": lr}, last_result={})


def test_running_line_lists_running_trials_with_progress_every_n_seconds(capsys):
    states = {
        "t_00000": {"epoch": 2, "epochs": 4, "batch": 9, "batches": 20, "eta_s": 12.0},
        "t_00002": {"epoch": 1, "epochs": 4, "batch": 20, "batches": 20, "eta_s": 0.0},
    }
    clock = FakeClock()
    view = ProgressCallback("val/sumr", "max", 3, lambda c: f"lr={c['train.lr']:g}", progress_of=lambda t: states.get(t.trial_id), every_s=10.0, clock=clock)
    trials = [trial("t_00000", "RUNNING", 1e-3), trial("t_00001", "RUNNING", 2e-3), trial("t_00002", "RUNNING", 3e-3), trial("t_00003", "TERMINATED", 4e-3)]
    assert view.running_line(trials) == (
        "running: t_00000 epoch 2/4 45% (ETA 12s)  lr=0.001; t_00002 epoch 1/4 100% (ETA 0s)  lr=0.003"
    )  # t_00001 has written no progress yet, t_00003 is done
    for _ in range(25):  # Tune's loop steps every 1 s for 25 s
        clock.t += 1.0
        view.on_step_end(0, trials)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "running:" in ln]
    assert len(lines) == 2  # at 10 s and 20 s
    assert view.running_line([trial("t_00001", "RUNNING", 1e-3)]) is None


def test_an_ended_trial_restored_by_tune_is_announced_as_a_replay(capsys, tmp_path):
    from prvrlab.platform.search.outcome import read_outcome, write_outcome

    ended = trial("t_00000", "RUNNING", 1e-3)
    fresh = trial("t_00001", "RUNNING", 2e-3)
    write_outcome(tmp_path / ended.trial_id, {"kind": "final", "val/sumr": 201.5, "config": {"x": 1}, "date": object()})
    assert read_outcome(tmp_path / ended.trial_id) == {"kind": "final", "val/sumr": 201.5}  # metrics and kind only
    assert read_outcome(tmp_path / fresh.trial_id) is None
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "outcome.json").write_text("{not json")
    assert read_outcome(tmp_path / "broken") is None

    view = ProgressCallback("val/sumr", "max", 2, lambda c: f"lr={c['train.lr']:g}", ended=lambda t: read_outcome(tmp_path / t.trial_id) is not None)
    view.on_trial_start(0, [ended, fresh], ended)
    view.on_trial_start(0, [ended, fresh], fresh)
    out = capsys.readouterr().out
    assert "replay t_00000" in out and "start  t_00000" not in out
    assert "start  t_00001  lr=0.002" in out


def test_the_count_of_a_resumed_ablation_includes_the_finished_trials_tune_restored(capsys):
    """A resumed ablation runs only its cells left (total 1 here), but Tune's restored trial list also holds
    a cell that finished before the interruption: the line said '2/1 done'; the total is never below the
    trials Tune lists."""
    view = ProgressCallback("val/sumr", "max", 1, lambda c: f"lr={c['train.lr']:g}")
    restored, rerun = trial("t_00000", "TERMINATED", 1e-3), trial("t_00001", "RUNNING", 2e-3)
    view.on_trial_complete(0, [restored, rerun], rerun)
    assert "2/2 done (0 failed), 0 running" in capsys.readouterr().out
    assert view._counts([trial("t_00002", "RUNNING", 1e-3)]).startswith("0/1 done")  # never below the planned total


def test_the_best_so_far_of_a_resumed_study_includes_the_trials_tune_restored(capsys):
    """A trial that finished before the interruption reports nothing after the resume: its restored result
    still counts for the best (the line said 150.81 while the study's best was 197.58)."""
    view = ProgressCallback("val/sumr", "max", 3, lambda c: f"lr={c['train.lr']:g}")
    restored, fresh = trial("t_00000", "TERMINATED", 1e-3), trial("t_00001", "RUNNING", 2e-3)
    restored.last_result = {"kind": "final", "val/sumr": 197.58}
    view.on_trial_result(0, [restored, fresh], fresh, {"kind": "epoch", "epoch": 1, "val/sumr": 150.81})
    assert "best val/sumr 197.58 (t_00000)" in capsys.readouterr().out
    view = ProgressCallback("val/sumr", "min", 3, lambda c: "")  # the better one, either way
    view.on_trial_result(0, [restored, fresh], fresh, {"kind": "epoch", "epoch": 1, "val/sumr": 150.81})
    assert "best val/sumr 150.81 (t_00001)" in capsys.readouterr().out


def test_a_resumed_study_counts_the_trials_of_its_first_submission(tmp_path):
    """A resumed ablation's caller counts only the cells left to run (3 of 4 here), while Tune restores the
    first submission's trials: the lines said 1/3 done, then 3/4."""
    from prvrlab.platform.search.outcome import RunMap
    from prvrlab.platform.search.study import trials_total

    RunMap(tmp_path).save()
    assert trials_total(tmp_path, 4, resume=False) == 4
    assert trials_total(tmp_path, 3, resume=True) == 4
    assert RunMap(tmp_path).meta["trials_total"] == 4
    assert trials_total(tmp_path, 2, resume=False) == 2  # a new submission records its own
    fresh = tmp_path / "older"
    fresh.mkdir()
    assert trials_total(fresh, 3, resume=True) == 3  # recorded before there was a count: the caller's


def test_a_trial_that_fails_is_dropped_from_the_best_so_far(capsys):
    """A trial that reported the best value and then failed (non-finite loss, or crashed for good) is no
    one's best, as the search's own best_trial has it."""
    view = ProgressCallback("val/sumr", "max", 3, lambda c: f"lr={c['train.lr']:g}")
    high, low, crash = trial("t_a", "RUNNING", 1e-3), trial("t_b", "RUNNING", 2e-3), trial("t_c", "RUNNING", 3e-3)
    view.on_trial_result(0, [high, low, crash], high, {"kind": "epoch", "epoch": 1, "val/sumr": 190.0})
    view.on_trial_result(0, [high, low, crash], low, {"kind": "epoch", "epoch": 1, "val/sumr": 150.0})
    view.on_trial_result(0, [high, low, crash], crash, {"kind": "epoch", "epoch": 1, "val/sumr": 170.0})
    assert "best val/sumr 190.00 (t_a)" in capsys.readouterr().out
    high.status, high.last_result = "TERMINATED", {"kind": "nonfinite", "epoch": 2, "error": "non-finite loss"}
    view.on_trial_complete(0, [high, low, crash], high)
    assert "2 running | best val/sumr 170.00 (t_c)" in capsys.readouterr().out
    crash.status = "ERROR"
    view.on_trial_result(0, [high, low, crash], low, {"kind": "epoch", "epoch": 2, "val/sumr": 151.0})
    assert "best val/sumr 151.00 (t_b)" in capsys.readouterr().out
