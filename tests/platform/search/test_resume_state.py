"""A driver killed while Tune copies its state leaves files from two moments; ``--resume`` agrees
with the restored trial list anyway (no trial sampled twice over the budget, no lost slot skipped).

Tune writes ``experiment_state-*.json`` (the trials), the Optuna searcher and
``search_gen_state-*.json`` (the generator's counter, the concurrency limiter's live set) one
after the other. Both torn states are built here from real Tune objects, without racing a kill.
"""

from __future__ import annotations

import json

import optuna
import pytest
from ray.tune.experiment.trial import Trial
from prvrlab.platform.search.resumable import ListSearcher, ResumableSearchGenerator, resumable, restored_trials
from prvrlab.platform.search.tuning import TolerantOptunaSearch


def _space(trial) -> dict:
    return {"train.lr": trial.suggest_float("train.lr", 1e-4, 1e-2, log=True)}


def _generator(budget: int = 3) -> ResumableSearchGenerator:
    searcher = TolerantOptunaSearch(
        space=_space,
        metric="val/sumr", mode="max", sampler=optuna.samplers.RandomSampler(seed=0), seed=0,
    )
    gen = resumable(searcher, max_concurrent=2)
    gen._total_samples = budget
    return gen


def _ask(gen: ResumableSearchGenerator, trial_id: str) -> None:
    """What ``next_trial`` does for one trial: ask the limiter (and Optuna), count it."""
    assert gen.searcher.suggest(trial_id) is not None
    gen._counter += 1


def _write_trials(folder, session: str, statuses: dict[str, str], cell: bool = False) -> None:
    """An ``experiment_state`` file in Tune's format holding these trials (``cell``: trial i holds
    the i-th cell of :func:`_cells`, the order they are handed out in)."""
    data = []
    for trial_id, status in statuses.items():
        config = {"cell": f"v{'abc'.index(trial_id)}/seed0"} if cell else {}
        trial = Trial("trainable", config=config, trial_id=trial_id, stub=True)
        trial.status = status
        data.append(list(trial.get_json_state()))
    (folder / f"experiment_state-{session}.json").write_text(json.dumps({"trial_data": data, "runner_data": {}}))


def _optuna_states(gen: ResumableSearchGenerator) -> dict[str, str]:
    searcher = gen.searcher.searcher
    states = {frozen._trial_id: frozen.state.name for frozen in searcher._ot_study.trials}
    return {t: states[ot._trial_id] for t, ot in searcher._ot_trials.items()}


def test_restored_trials_reads_the_newest_state_as_plain_json(tmp_path):
    _write_trials(tmp_path, "2026-11-26_10-00-00", {"a": Trial.TERMINATED})
    _write_trials(tmp_path, "2026-11-26_10-00-09", {"a": Trial.TERMINATED, "b": Trial.RUNNING})
    assert {t: r.status for t, r in restored_trials(tmp_path).items()} == {"a": "TERMINATED", "b": "RUNNING"}
    assert restored_trials(tmp_path / "missing") is None


def test_a_counter_older_than_the_trial_list_samples_no_trial_over_the_budget(tmp_path):
    old = _generator()
    _ask(old, "a")
    _ask(old, "b")
    old.save_to_dir(str(tmp_path), session_str="s")  # counter 2, live {a, b}
    old.on_trial_complete("a", {"val/sumr": 100.0})
    _ask(old, "c")
    old.searcher.searcher.save_to_dir(str(tmp_path), session_str="s")  # Optuna written again, the counter not
    _write_trials(tmp_path, "s", {"a": Trial.TERMINATED, "b": Trial.RUNNING, "c": Trial.RUNNING})

    stock = _generator()
    super(ResumableSearchGenerator, stock).restore_from_dir(str(tmp_path))
    assert not stock.is_finished()  # Tune's own restore would sample a 4th trial

    gen = _generator()
    gen.restore_from_dir(str(tmp_path))
    assert gen._counter == 3 and gen.is_finished()
    assert gen.searcher.live_trials == {"b", "c"} and gen.searcher.num_unfinished_live_trials == 2
    gen.on_trial_complete("c", {"val/sumr": 150.0})  # c reaches Optuna although the old live set lacked it
    assert _optuna_states(gen)["c"] == "COMPLETE" and gen.searcher.live_trials == {"b"}


def test_a_trial_missing_from_the_trial_list_gets_its_slot_sampled_again(tmp_path):
    old = _generator()
    _ask(old, "a")
    _ask(old, "b")
    old.on_trial_complete("a", {"val/sumr": 100.0})
    _ask(old, "lost")
    old.save_to_dir(str(tmp_path), session_str="s")  # counter 3, live {b, lost}
    _write_trials(tmp_path, "s", {"a": Trial.TERMINATED, "b": Trial.RUNNING})

    gen = _generator()
    gen.restore_from_dir(str(tmp_path))
    assert gen._counter == 2 and not gen.is_finished()
    assert gen.searcher.live_trials == {"b"}
    assert "lost" not in gen.searcher.searcher._ot_trials
    assert sorted(t.state.name for t in gen.searcher.searcher._ot_study.trials) == ["COMPLETE", "FAIL", "RUNNING"]
    _ask(gen, "again")  # the free slot is asked for again
    assert gen.is_finished()


def test_reports_of_a_trial_optuna_never_asked_for_are_skipped():
    gen = _generator()
    _ask(gen, "a")
    searcher = gen.searcher.searcher
    searcher.on_trial_result("unknown", {"val/sumr": 1.0, "training_iteration": 1})
    searcher.on_trial_complete("unknown", {"val/sumr": 1.0})
    searcher.on_trial_complete("a", {"val/sumr": 2.0})
    assert _optuna_states(gen) == {"a": "COMPLETE"}


def _cells(budget: int = 3) -> ResumableSearchGenerator:
    gen = resumable(ListSearcher([{"cell": f"v{i}/seed0"} for i in range(budget)]), max_concurrent=2)
    gen._total_samples = budget
    return gen


def test_an_ablation_hands_out_each_cell_once_in_order_and_finishes():
    gen = _cells()
    assert [gen.searcher.suggest(t) for t in ("a", "b")] == [{"cell": "v0/seed0"}, {"cell": "v1/seed0"}]
    assert gen.searcher.suggest("c") is None  # two at a time
    gen.on_trial_complete("a", {})
    assert gen.searcher.suggest("c") == {"cell": "v2/seed0"}
    gen.on_trial_complete("b", {})
    assert gen.searcher.suggest("d") == ListSearcher.FINISHED


def test_a_restored_ablation_gives_no_cell_twice_and_a_lost_cell_again(tmp_path):
    old = _cells()
    for trial_id in ("a", "b"):
        _ask(old, trial_id)
    old.save_to_dir(str(tmp_path), session_str="s")  # counter 2; the state of the cells is plain JSON
    assert json.loads((tmp_path / "searcher-state-s.pkl").read_text())["given"] == {"a": 0, "b": 1}
    old.on_trial_complete("a", {})
    _ask(old, "c")
    old.searcher.searcher.save_to_dir(str(tmp_path), session_str="s")
    _write_trials(tmp_path, "s", {"a": Trial.TERMINATED, "b": Trial.RUNNING, "c": Trial.RUNNING}, cell=True)
    gen = _cells()
    gen.restore_from_dir(str(tmp_path))
    assert gen.is_finished() and gen.searcher.live_trials == {"b", "c"}

    _write_trials(tmp_path, "s", {"a": Trial.TERMINATED, "c": Trial.RUNNING}, cell=True)  # b lost
    gen = _cells()
    gen.restore_from_dir(str(tmp_path))
    assert not gen.is_finished()
    assert gen.searcher.suggest("again") == {"cell": "v1/seed0"}  # b's cell, nothing else


GRID = [1e-4, 2e-4, 4e-4, 8e-4]


def _grid_space(trial) -> dict:
    return {"train.lr": trial.suggest_categorical("train.lr", GRID)}


def _grid() -> ResumableSearchGenerator:
    """A grid search over GRID as ``tuning._searcher`` builds it, all points at once, a budget of the grid size."""
    searcher = TolerantOptunaSearch(
        space=_grid_space,
        metric="val/sumr", mode="max", sampler=optuna.samplers.GridSampler({"train.lr": GRID}, seed=0), seed=0,
    )
    gen = resumable(searcher, max_concurrent=len(GRID))
    gen._total_samples = len(GRID)
    return gen


def _grid_resumed(tmp_path, ended: list[str], lost: list[str]) -> tuple[ResumableSearchGenerator, dict[str, float]]:
    """Trials ``ended`` + ``lost`` asked in order, the ended ones completed, the driver killed after Tune saved a
    trial list without the lost ones; returns the resumed generator and trial id -> lr of the trials asked."""
    old = _grid()
    asked = {}
    for trial_id in ended + lost:
        asked[trial_id] = old.searcher.suggest(trial_id)["train.lr"]
        old._counter += 1
    for trial_id in ended:
        old.on_trial_complete(trial_id, {"val/sumr": 100.0})
    old.save_to_dir(str(tmp_path), session_str="s")
    _write_trials(tmp_path, "s", {t: Trial.TERMINATED for t in ended})
    gen = _grid()
    gen.restore_from_dir(str(tmp_path))
    return gen, asked


def _suggest_rest(gen: ResumableSearchGenerator) -> list[float]:
    """The lr of every trial Tune asks for until the budget is spent."""
    lrs = []
    while not gen.is_finished():
        lrs.append(gen.searcher.suggest(f"new{len(lrs)}")["train.lr"])
        gen._counter += 1
    return lrs


def test_a_resumed_grid_search_whose_last_point_was_lost_trains_it(tmp_path):
    """The lost trial held the grid's last unfinished point: closing it FAIL makes the grid sampler stop the
    study (Study.stop outside optimize raised RuntimeError); the resume goes on and trains that point."""
    gen, asked = _grid_resumed(tmp_path, ["a", "b", "c"], ["lost"])
    searcher = gen.searcher.searcher
    assert "lost" not in searcher._ot_trials
    states = sorted(t.state.name for t in searcher._ot_study.trials)
    assert states == ["COMPLETE", "COMPLETE", "COMPLETE", "FAIL", "WAITING"]  # the lost point queued again
    assert sorted(asked.values()) == sorted(GRID)
    assert _suggest_rest(gen) == [asked["lost"]]  # the one free slot trains the lost point, nothing else


def test_a_resumed_grid_search_trains_every_point_once_more_after_a_lost_trial(tmp_path):
    """A lost trial mid-grid: its point is trained again (a failed point counts as visited for Optuna's grid
    sampler, which would hand out the other points only), the remaining points once each."""
    gen, asked = _grid_resumed(tmp_path, ["a"], ["lost"])
    rest = _suggest_rest(gen)
    assert len(rest) == len(GRID) - 1 and rest[0] == asked["lost"]
    assert sorted([asked["a"], *rest]) == sorted(GRID)


def test_a_searcher_state_cut_short_is_rebuilt_from_the_trial_list(tmp_path, caplog):
    """A driver killed while Tune copied its state leaves a file cut short (an empty ``searcher-state`` was
    seen): Tune's restore failed half way, the limiter's live set restored and nothing after it, and the
    resumed study waited for ever for a trial that would never run.  The restore now goes on from the
    trial list: each cell once, the lost one again, and the search ends."""
    old = _cells()
    for trial_id in ("a", "b"):
        _ask(old, trial_id)
    old.save_to_dir(str(tmp_path), session_str="s")
    (tmp_path / "searcher-state-s.pkl").write_text("")  # cut short
    _write_trials(tmp_path, "s", {"a": Trial.TERMINATED, "b": Trial.RUNNING}, cell=True)
    gen = _cells()
    gen.restore_from_dir(str(tmp_path))
    assert "could not be read" in caplog.text and "(ListSearcher;" in caplog.text
    assert gen._counter == 2 and gen.searcher.live_trials == {"b"}
    assert gen.searcher.searcher.given == {"a": 0, "b": 1}
    assert gen.searcher.suggest("c") == {"cell": "v2/seed0"}  # the free slot: the third cell, not a's or b's
    assert gen.searcher.suggest("d") is None  # two at a time
    gen.on_trial_complete("b", {})
    assert gen.searcher.suggest("d") == ListSearcher.FINISHED



def test_after_a_cut_short_searcher_state_the_budget_and_experiment_come_back_and_new_cells_run(tmp_path):
    """On Tune's resume the generator comes from tuner.pkl, pickled before the experiment was added (no
    budget, no experiment), and Tune does not add it again: both must come from the saved generator state
    even where the base searcher's state cannot be read, or the search ends at once with cells never run."""
    old = _cells(budget=4)
    old._experiment = "the experiment"  # what Tune's Experiment would be: restored as saved
    for trial_id in ("a", "b"):
        _ask(old, trial_id)
    old.save_to_dir(str(tmp_path), session_str="s")
    (tmp_path / "searcher-state-s.pkl").write_text("")  # cut short
    _write_trials(tmp_path, "s", {"a": Trial.TERMINATED, "b": Trial.RUNNING}, cell=True)
    gen = resumable(ListSearcher([{"cell": f"v{i}/seed0"} for i in range(4)]), max_concurrent=2)
    assert gen._total_samples == 0 and gen._experiment is None  # as tuner.pkl holds it
    gen.restore_from_dir(str(tmp_path))
    assert (gen._total_samples, gen._experiment, gen._counter) == (4, "the experiment", 2)
    assert not gen.is_finished()
    assert gen.searcher.suggest("c") == {"cell": "v2/seed0"}
    gen.on_trial_complete("b", {})
    assert gen.searcher.suggest("d") == {"cell": "v3/seed0"}


def test_an_optuna_state_cut_short_resumes_without_its_history_and_within_the_budget(tmp_path, caplog):
    old = _generator(budget=3)
    for trial_id in ("a", "b"):
        _ask(old, trial_id)
    old.save_to_dir(str(tmp_path), session_str="s")
    (tmp_path / "searcher-state-s.pkl").write_bytes(b"\x80\x04")  # a pickle cut short
    _write_trials(tmp_path, "s", {"a": Trial.TERMINATED, "b": Trial.RUNNING})
    gen = _generator(budget=3)
    gen.restore_from_dir(str(tmp_path))
    assert "(TolerantOptunaSearch; a searcher that learns" in caplog.text
    assert gen._counter == 2 and gen.searcher.live_trials == {"b"}
    gen.on_trial_complete("b", {"val/sumr": 1.0})  # a trial Optuna never asked for: skipped, slot freed
    _ask(gen, "c")
    assert gen._counter == 3  # the budget's last trial


def test_an_unreadable_trial_list_leaves_no_slot_taken_for_the_new_experiment(tmp_path):
    """Without a readable trial list Tune starts a new experiment: the error goes on to Tune, and the
    limiter holds no trial of the old one (it had restored its live set before the failure)."""
    old = _cells()
    for trial_id in ("a", "b"):
        _ask(old, trial_id)
    old.save_to_dir(str(tmp_path), session_str="s")
    (tmp_path / "searcher-state-s.pkl").write_text("")
    for trial_list in ('{"trial_data": [', '{"trial_data": null}'):  # cut short; of another shape
        (tmp_path / "experiment_state-s.json").write_text(trial_list)
        gen = _cells()
        with pytest.raises(ValueError):  # the searcher state's own error, for Tune to restart on
            gen.restore_from_dir(str(tmp_path))
        assert gen._counter == 0 and gen.searcher.live_trials == set()
        assert gen.searcher.suggest("x") == {"cell": "v0/seed0"}
