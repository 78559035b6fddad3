"""A concise live view of a search or ablation (one line per event).

Replaces Ray's raw log stream: each trial report prints the study's counts
(done / running / failed), the best metric so far and the trial's own
parameters and current metric; every ``$PRVRLAB_PROGRESS_S`` seconds
(default 10) one ``running:`` line gives each running trial's epoch and
in-epoch progress, read from the ``progress.json`` its rank 0 keeps in the
trial folder (:mod:`prvrlab.platform.train.live`).  Ray's full logs stay in
its session folder.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any, Callable

from ray.tune import Callback

from prvrlab.platform.search.outcome import FAILED_OUTCOMES, trial_error, trial_outcome
from prvrlab.platform.train.live import short_progress


class ProgressCallback(Callback):
    """Prints one line per trial start, epoch, completion and failure."""

    def __init__(
        self,
        metric: str,
        mode: str,
        total: int,
        labels: Callable[[dict[str, Any]], str],
        progress_of: Callable[[Any], dict[str, Any] | None] | None = None,
        ended: Callable[[Any], bool] | None = None,
        every_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        from prvrlab.platform.train.live import every_s_from_env

        self.metric, self.mode, self.total, self.labels = metric, mode, total, labels
        self.progress_of = progress_of
        self.ended = ended
        self.every_s = every_s_from_env() if every_s is None else every_s
        self.clock = clock
        self.last_running = clock()
        self.best: dict[str, float] = {}
        self.t0 = time.time()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "best": {}, "t0": 0.0}

    def running_line(self, trials) -> str | None:
        """``running: <trial> epoch 2/4 45% (ETA 12s) <params>; ...`` from the trials' progress, or None."""
        parts = []
        for t in trials:
            if t.status != "RUNNING" or self.progress_of is None:
                continue
            state = self.progress_of(t)
            if state is not None:
                parts.append(f"{t.trial_id} {short_progress(state)}  {self.labels(t.config)}")
        return "running: " + "; ".join(parts) if parts else None

    def on_step_end(self, iteration, trials, **info) -> None:
        """Every ``every_s`` seconds: the running trials' in-epoch progress (one line)."""
        now = self.clock()
        if now - self.last_running < max(self.every_s, 1.0):
            return
        self.last_running = now
        line = self.running_line(trials)
        if line:
            self._echo(line)

    def _echo(self, text: str) -> None:
        if not self.t0:
            self.t0 = time.time()
        print(f"[{time.time() - self.t0:6.0f}s] {text}", file=sys.stdout, flush=True)

    def _better(self, a: float, b: float) -> bool:
        return a > b if self.mode == "max" else a < b

    def _counts(self, trials, ended=None, error: bool = False) -> str:
        done = failed = running = 0
        for t in trials:
            status = ("ERROR" if error else "TERMINATED") if t is ended else t.status
            if status == "ERROR" or (status == "TERMINATED" and trial_outcome(t.last_result) in FAILED_OUTCOMES):
                failed += 1
                self.best.pop(t.trial_id, None)  # as tuning.best_trial: a failed trial is no one's best
                continue
            if t.trial_id not in self.best and t.last_result:  # restored by a resume: reported before it
                self._note(t, t.last_result)
                # its best over every result it reported (Tune keeps each metric's max and min with the trial)
                reported = (getattr(t, "metric_analysis", None) or {}).get(self.metric) or {}
                self._note(t, {self.metric: reported.get("max" if self.mode == "max" else "min")})
            if status == "TERMINATED":
                done += 1
            elif status == "RUNNING":
                running += 1
        best = self._overall_best()
        best_text = f"best {self.metric} {best[1]:.2f} ({best[0]})" if best else f"best {self.metric} -"
        total = max(self.total, len(trials))  # the first submission's count (study.trials_total), or more
        return f"{done + failed}/{total} done ({failed} failed), {running} running | {best_text}"

    def _overall_best(self) -> tuple[str, float] | None:
        best = None
        for trial_id, value in self.best.items():
            if best is None or self._better(value, best[1]):
                best = (trial_id, value)
        return best

    def _note(self, trial, result: dict[str, Any]) -> None:
        value = result.get(self.metric)
        if isinstance(value, (int, float)) and math.isfinite(value):
            old = self.best.get(trial.trial_id)
            if old is None or self._better(value, old):
                self.best[trial.trial_id] = float(value)

    def on_trial_start(self, iteration, trials, trial, **info) -> None:
        """Announce a trial and its parameters (or that an ended one only reports its recorded result)."""
        if self.ended is not None and self.ended(trial):
            self._echo(f"replay {trial.trial_id}  ended before the driver stopped: its recorded result is reused")
            return
        self._echo(f"start  {trial.trial_id}  {self.labels(trial.config)}")

    def on_trial_result(self, iteration, trials, trial, result, **info) -> None:
        """One line per epoch report."""
        self._note(trial, result)
        if result.get("kind") != "epoch":
            return
        value = result.get(self.metric)
        shown = f"{value:.2f}" if isinstance(value, (int, float)) else "-"
        self._echo(
            f"{self._counts(trials)} | {trial.trial_id} epoch {int(result['epoch'])} "
            f"{self.metric} {shown}  {self.labels(trial.config)}"
        )

    def on_trial_complete(self, iteration, trials, trial, **info) -> None:
        """The trial's outcome and the new counts."""
        outcome = trial_outcome(trial.last_result)
        extra = f": {trial.last_result.get('error')}" if outcome in FAILED_OUTCOMES else ""
        self._echo(f"{outcome:<13} {trial.trial_id}{extra} | {self._counts(trials, ended=trial)}")

    def on_trial_recover(self, iteration, trials, trial, **info) -> None:
        """A crashed trial is being retried."""
        self._echo(f"retry  {trial.trial_id} from its last checkpoint: {trial_error(trial)[1].summary} | {self._counts(trials)}")

    def on_trial_error(self, iteration, trials, trial, **info) -> None:
        """A trial failed for good."""
        self._echo(f"failed {trial.trial_id}: {trial_error(trial)[1].summary} | {self._counts(trials, ended=trial, error=True)}")
