"""Search algorithms whose ``--resume`` agrees with the trial list Tune restores.

Tune writes its trial list (``experiment_state-*.json``), the base searcher's state and the
generator's own state (``search_gen_state-*.json``: trial counter, concurrency limiter's live set)
one after the other, and copies them to the study folder in the background. A driver killed
between two of them leaves files from two moments: a counter older than the trial list samples a
trial over the budget; a trial missing from the list (started after the last save) would keep its
slot taken. A driver killed while a file was being copied leaves it cut short (an empty
``searcher-state`` file was seen): Tune's restore then failed half way, with the limiter's live set
restored and nothing after it, and Tune went on as a new experiment whose limiter waited for a
trial that would never run, for ever. :class:`ResumableSearchGenerator` makes the restored state agree
with the restored trials, and resumes from the trial list alone where the base searcher's state cannot
be read; a base searcher that defines ``forget_lost(trials)`` is told which trials those are.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, NamedTuple

from ray.tune.search import ConcurrencyLimiter, Searcher
from ray.tune.search.search_generator import SearchGenerator
from ray.tune.utils.util import _load_newest_checkpoint

ENDED = ("TERMINATED", "ERROR")
logger = logging.getLogger(__name__)


class RestoredTrial(NamedTuple):
    """What a restored trial is: its Tune status and its sampled config."""

    status: str
    config: dict[str, Any]


def restored_trials(dirpath: str | Path) -> dict[str, RestoredTrial] | None:
    """Trial id -> :class:`RestoredTrial` in the newest experiment state under ``dirpath`` (the file
    Tune restores from), read as plain JSON: no embedded pickle is expanded. None when there is none."""
    from ray.tune.execution.tune_controller import TuneController

    files = sorted(Path(dirpath).glob(TuneController.CKPT_FILE_TMPL.format("*")))
    if not files:
        return None
    trials = {}
    for trial_json, _ in json.loads(files[-1].read_text())["trial_data"]:
        trial = json.loads(trial_json)
        config = trial.get("config")
        trials[trial["trial_id"]] = RestoredTrial(trial["status"], config if isinstance(config, dict) else {})
    return trials


class ResumableSearchGenerator(SearchGenerator):
    """Tune's SearchGenerator whose restored state agrees with the restored trials.

    On restore the trial counter becomes the number of restored trials (so a lost trial's slot is
    sampled again and no trial is sampled over the budget), the concurrency limiter's live set
    their unfinished ones, and the base searcher's ``forget_lost`` (if any) is given the trials.
    Where the base searcher's state cannot be read but the trial list can, the search resumes from the
    trial list (the generator's counter, budget and experiment restored as saved): an ablation's cells
    are rebuilt exactly; a searcher that learns (Optuna) goes on without the restored trials' results and
    may sample points it tried before, and a warning says so.  (A generator state cut short fails in
    Tune's own check before this restore; Tune then starts a new experiment.)
    """

    def restore_from_dir(self, dirpath: str) -> None:
        """Tune's restore (the generator's own state, its wrappers', then the base searcher's), where a
        base searcher's state that cannot be read does not stop the rest: the generator's counter, budget
        and experiment are set either way, then everything is made to agree with the trial list."""
        state = _load_newest_checkpoint(dirpath, self.CKPT_FILE_TMPL.format("*"))
        if not state:
            raise RuntimeError(f"no search state to restore in {dirpath}")
        searcher = self.searcher
        while hasattr(searcher, "searcher"):  # the wrappers' states, as Tune saved them by class name
            wrapper = state.pop("name:" + type(searcher).__name__, None)
            if wrapper is not None:
                searcher.set_state(wrapper)
            searcher = searcher.searcher
        failed = None
        try:
            searcher.restore_from_dir(dirpath)
        except Exception as exc:  # noqa: BLE001 - a file cut short, or anything else: the trial list decides
            failed = exc
        try:
            trials = restored_trials(dirpath)
        except Exception:  # noqa: BLE001 - cut short or of another shape: as if there were none
            trials = None
        if failed is not None and trials is None:  # Tune starts a new experiment: no old trial holds a slot
            self._agree_with({})
            raise failed
        self.set_state(state)  # counter, budget, finished, experiment: Tune skips adding the experiment on resume
        if failed is not None:
            logger.warning(
                "the search state in %s could not be read (%s: %s; a driver killed while it was being copied "
                "leaves it cut short): resuming from the trial list alone (%s; a searcher that learns from "
                "results, as Optuna does, goes on without the restored trials' ones and may sample points "
                "it tried before)",
                dirpath, type(failed).__name__, failed, type(searcher).__name__,
            )
        if trials is not None:
            self._agree_with(trials)

    def _agree_with(self, trials: dict[str, RestoredTrial]) -> None:
        """Counter, live set and the base searcher's lost trials as the restored ``trials`` say."""
        self._counter = len(trials)
        self._finished = False  # asked again: an exhausted searcher says so at its next suggestion
        searcher = self.searcher
        if isinstance(searcher, ConcurrencyLimiter):
            searcher.live_trials = {t for t, trial in trials.items() if trial.status not in ENDED}
            searcher.num_unfinished_live_trials = len(searcher.live_trials)
            searcher.cached_results = {}
            searcher = searcher.searcher
        forget = getattr(searcher, "forget_lost", None)
        if forget is not None:
            forget(trials)


def resumable(searcher: Searcher, max_concurrent: int) -> ResumableSearchGenerator:
    """``searcher`` limited to ``max_concurrent`` trials at a time, in a resumable generator."""
    return ResumableSearchGenerator(ConcurrencyLimiter(searcher, max_concurrent=max_concurrent))


class ListSearcher(Searcher):
    """Hands out fixed configs in order, each to one trial (an ablation's cells).

    Its state is plain JSON. On restore, the configs of trials Tune lost are handed out again and
    none of a restored trial twice.
    """

    def __init__(self, configs: list[dict[str, Any]]) -> None:
        super().__init__()
        self.configs = [dict(c) for c in configs]
        self.given: dict[str, int] = {}  # trial id -> index into configs

    def suggest(self, trial_id: str) -> dict[str, Any] | str:
        taken = set(self.given.values())
        for index, config in enumerate(self.configs):
            if index not in taken:
                self.given[trial_id] = index
                return dict(config)
        return Searcher.FINISHED

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        """Nothing to learn: the configs are fixed."""

    def forget_lost(self, trials: dict[str, RestoredTrial]) -> None:
        """Only restored trials hold their config."""
        self.given = {t: self.configs.index(trial.config) for t, trial in trials.items() if trial.config in self.configs}

    def save(self, checkpoint_path: str) -> None:
        Path(checkpoint_path).write_text(json.dumps({"configs": self.configs, "given": self.given}))

    def restore(self, checkpoint_path: str) -> None:
        state = json.loads(Path(checkpoint_path).read_text())
        self.configs, self.given = state["configs"], state["given"]
