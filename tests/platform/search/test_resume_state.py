"""A driver killed while Tune copies its state leaves files from two moments; ``--resume`` agrees
with the restored trial list anyway (no trial sampled twice over the budget, no lost slot skipped).

Tune writes ``experiment_state-*.json`` (the trials), the Optuna searcher and
``search_gen_state-*.json`` (the generator's counter, the concurrency limiter's live set) one
after the other. Both torn states are built here from real Tune objects, without racing a kill.
"""

from __future__ import annotations

import json

import optuna
from ray.tune.experiment.trial import Trial
from ray.tune.search import ConcurrencyLimiter

from prvrlab.platform.search.tuning import ResumableSearchGenerator, TolerantOptunaSearch, restored_trials


def _space(trial) -> dict:
    return {"train.lr": trial.suggest_float("train.lr", 1e-4, 1e-2, log=True)}


def _generator(budget: int = 3) -> ResumableSearchGenerator:
    searcher = TolerantOptunaSearch(
        space=_space,
        metric="val/sumr", mode="max", sampler=optuna.samplers.RandomSampler(seed=0), seed=0,
    )
    gen = ResumableSearchGenerator(ConcurrencyLimiter(searcher, max_concurrent=2))
    gen._total_samples = budget
    return gen


def _ask(gen: ResumableSearchGenerator, trial_id: str) -> None:
    """What ``next_trial`` does for one trial: ask the limiter (and Optuna), count it."""
    assert gen.searcher.suggest(trial_id) is not None
    gen._counter += 1


def _write_trials(folder, session: str, statuses: dict[str, str]) -> None:
    """An ``experiment_state`` file in Tune's format holding these trials."""
    data = []
    for trial_id, status in statuses.items():
        trial = Trial("trainable", trial_id=trial_id, stub=True)
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
    assert restored_trials(tmp_path) == {"a": "TERMINATED", "b": "RUNNING"}
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
