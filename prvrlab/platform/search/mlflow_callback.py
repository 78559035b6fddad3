"""The driver-side MLflow writer of a search or ablation (a Ray Tune callback).

One child run per trial, nested under the study's parent run.  Only this
callback (in the driver process) writes to the tracking store; each trial
report becomes one batched ``log_batch``.  Every child run ends FINISHED,
FAILED or KILLED:

- finished at full budget: FINISHED, ``prvrlab.status=finished``;
- stopped by the scheduler (ASHA) or the time limit: FINISHED with
  ``prvrlab.early_stopped=true`` and ``prvrlab.status=early_stopped``;
- non-finite loss: FAILED, ``prvrlab.status=nonfinite`` and the error tag;
- a sampled config that does not validate: FAILED, ``prvrlab.status=error`` and the error tag;
- an error in the training code (not retried) or crashed beyond its retries (an OOM kill,
  a dead worker): FAILED, ``prvrlab.status=error`` and the error tag, one plain line
  (:mod:`prvrlab.platform.failures`); the full text of every failure is the ``error.txt`` artifact;
- still running when the driver is interrupted: KILLED (reopened on ``--resume``).

The trial id -> run id map lives in ``<study dir>/study.json`` so that a
restored study reattaches to the same runs instead of duplicating them.
"""

from __future__ import annotations

import math
from contextlib import suppress
from typing import TYPE_CHECKING, Any

from ray.tune import Callback

from prvrlab.platform.config import ConfigError
from prvrlab.platform.failures import ERROR_FILE, record_failure
from prvrlab.platform import storage
from prvrlab.platform.tracking.drivers import driver_alive
from prvrlab.platform.tracking.store import best_point
from prvrlab.platform.search.checkpoints import repair_checkpoints
from prvrlab.platform.search.time_limit import time_limit_reason
from prvrlab.platform.search.outcome import (
    FILLED_KEY,
    INTERRUPTED,
    OUTCOME_FILE,
    TIME_LIMIT,
    RunMap,
    trial_error,
    trial_outcome,
    watch_interrupts,
    write_outcome,
)

if TYPE_CHECKING:
    from prvrlab.platform.search.study import StudyContext


class MlflowStudyCallback(Callback):
    """Writes a study's child runs from the Tune driver (picklable: the client is created lazily)."""

    def __init__(self, study: "StudyContext") -> None:
        self.study = study
        self._tracker = None
        self._map: RunMap | None = None
        self._open: set[str] = set()
        self._commit: str | None = None
        self._datasets: dict[str, Any] = {}
        self._lost_checked = False
        self._mirror: "storage.Mirror | None" = None
        self._repaired: dict[str, str] = {}
        self.cut: set[str] = set()  # trials budget.time_limit_s stopped (closed KILLED; their reports still count)

    def __getstate__(self) -> dict[str, Any]:
        return {
            "study": self.study, "_tracker": None, "_map": None, "_open": set(), "_commit": None, "_datasets": {},
            "_lost_checked": False, "_mirror": None, "_repaired": {}, "cut": set(),
        }

    # ------------------------------------------------------------ helpers

    @property
    def tracker(self):
        """The lazily created Tracker (one MlflowClient in the driver)."""
        if self._tracker is None:
            from prvrlab.platform.tracking.store import STUDY_SERVER_WAIT_S, Tracker

            self._tracker = Tracker(self.study.tracking_uri, self.study.experiment, wait_s=STUDY_SERVER_WAIT_S)
        return self._tracker

    @property
    def runs(self) -> RunMap:
        """The persisted trial -> run map."""
        if self._map is None:
            self._map = RunMap(self.study.study_dir)
        return self._map

    @property
    def mirror(self) -> "storage.Mirror":
        """Pushes the driver's study files to an object store (a no-op for local storage)."""
        if self._mirror is None:
            self._mirror = self.study.push_files()
        return self._mirror

    def _save(self) -> None:
        """Write the run map and push it (with any outcome or error just written) at once: a driver
        killed a moment later leaves the object store as current as a local folder."""
        self.runs.save()
        self.mirror.push()

    def _child_run(self, trial) -> str:
        """The child run of ``trial``: reattached when known, created otherwise."""
        trial_id = trial.trial_id
        run_id = self.runs.trials.get(trial_id)
        if run_id is not None:
            if self.runs.closed.get(trial_id) in ("FINISHED", "FAILED"):  # ended: replayed, never reopened
                return run_id
            if trial_id not in self._open and not INTERRUPTED.is_set():  # a stopping study reopens nothing
                before = self.tracker.reopen_run(run_id)
                was_killed = self.runs.closed.pop(trial_id, None) == "KILLED" or before.info.status == "KILLED"
                if was_killed or driver_alive(before.data.tags) is False:  # the closers' are unmapped; a dead
                    # driver's run is resumed whether or not its sentinel closed it first
                    self.tracker.set_tags(run_id, {"prvrlab.status": "resumed"})
                if trial_id in self._repaired:
                    self.tracker.set_tags(run_id, {"prvrlab.resume_note": self._repaired.pop(trial_id)})
                self._save()
                self._open.add(trial_id)
            return run_id
        from prvrlab.platform.tracking.store import git_commit

        if self._commit is None:
            self._commit = git_commit()
        try:
            cfg = self.study.experiment_config(trial.config)
        except ConfigError as exc:  # the trial reports it and ends FAILED
            cfg, tags = None, self.study.invalid_tags(trial.config, str(exc), commit=self._commit)
        else:
            tags = self.study.trial_tags(trial.config, cfg, commit=self._commit)
        number = len(self.runs.trials) + 1  # start order, kept across --resume by the run map
        tags.update({"prvrlab.trial_id": trial_id, "prvrlab.trial_number": str(number)})
        run_id = self.tracker.start_run(self.study.run_name(number, trial.config), tags=tags, parent_run_id=self.runs.parent)
        self.runs.trials[trial_id] = run_id  # mapped and open at once: the closers find it whatever fails next
        self._open.add(trial_id)
        try:
            self._save()
            if cfg is not None:
                self.tracker.log_params(run_id, cfg.flat())
                self.tracker.log_dataset(run_id, self._dataset(cfg))
            elif self.study.cells is None:  # a sampled config that does not validate: its values, as params
                self.tracker.log_params(run_id, dict(trial.config))
        except BaseException as exc:
            self._end_unrecorded(trial_id, run_id, exc)
            raise
        return run_id

    def _end_unrecorded(self, trial_id: str, run_id: str, exc: BaseException) -> None:
        """End the new child run whose params or map ``exc`` stopped (:meth:`Tracker.end_stopped`: KILLED and
        reopened on ``--resume`` after an interrupt, else FAILED with the error); one the store cannot end
        stays mapped and open."""
        reason = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
        status = self.tracker.end_stopped(
            run_id,
            exc,
            failed_tags={"prvrlab.status": "error", "error": f"recording the trial's run failed: {type(exc).__name__}: {reason}"},
            killed_tags={"prvrlab.status": "killed", "prvrlab.stop_reason": "interrupted"},
        )
        if status is None:
            return
        self._open.discard(trial_id)
        self.runs.closed[trial_id] = status
        with suppress(Exception):
            self._save()

    def _dataset(self, cfg):
        """The MLflow dataset of a trial's data (built once per distinct ``data`` section)."""
        import json

        from prvrlab.platform.tracking.datasets import dataset_of

        key = json.dumps(cfg.to_dict()["data"], sort_keys=True, default=str)
        if key not in self._datasets:
            self._datasets[key] = dataset_of(cfg.data)
        return self._datasets[key]

    def close(self, trial, status: str, tags: dict[str, Any]) -> None:
        """Log the trial's files, tag and end its run (idempotent)."""
        self.close_id(trial.trial_id, status, tags)

    def close_id(self, trial_id: str, status: str, tags: dict[str, Any]) -> None:
        """Close the child run of ``trial_id`` (files logged unless KILLED)."""
        run_id = self.runs.trials.get(trial_id)
        if run_id is None or self.runs.closed.get(trial_id) in ("FINISHED", "FAILED"):
            return
        tracker = self.tracker
        files = self.study.trial_dir(trial_id)
        if self.study.storage and status != "KILLED":  # object store: rank 0's files, wherever it ran
            storage.Location(self.study.trial_sync(trial_id)).pull(exclude=(OUTCOME_FILE,))
        tracker.log_artifacts(run_id, [files / ERROR_FILE])
        if status != "KILLED":
            from prvrlab.models.component import DISTRIBUTIONS_DIR  # here: trial actors load this module without torch

            tracker.log_artifacts(run_id, [files / "config.yaml"])
            tracker.log_artifacts(run_id, sorted(files.glob("ranks_*.parquet")), "ranks")
            tracker.log_artifacts(run_id, sorted((files / DISTRIBUTIONS_DIR).glob("*.json")), DISTRIBUTIONS_DIR)
            tracker.log_artifacts(run_id, [files / "best_model.pt"], "checkpoints")
        tracker.set_tags(run_id, tags)
        tracker.end_run(run_id, status)
        self._open.discard(trial_id)
        self.runs.closed[trial_id] = status
        self._save()

    def close_lost(self, trials) -> None:
        """Close KILLED the open child runs of trials that Tune's restored state does not hold.

        Tune saves its state every few seconds; a trial started just before the driver was
        killed is unknown after ``--resume`` (the searcher samples that slot again, as a new
        trial), so its child run would otherwise stay RUNNING forever. With an object store the
        run map itself can lag (the kill cut its push short): a child run of the parent that the
        map does not hold is entered in the map. Unless Tune holds its trial (which then
        reattaches to it) a RUNNING one is closed KILLED as lost, and a KILLED one (closed by the
        run sentinel when the driver died) is re-tagged lost; an ended one is kept as ended.
        """
        known = {t.trial_id for t in trials}
        lost = {"prvrlab.status": "killed", "prvrlab.stop_reason": "lost: the driver was killed before Tune saved this trial; its slot was sampled again"}
        for trial_id in list(self.runs.trials):
            if trial_id not in known and self.runs.closed.get(trial_id) is None:
                self.tracker.take_over(self.runs.trials[trial_id])  # the dead driver's sentinel then leaves it
                self.close_id(trial_id, "KILLED", lost)
        if not self.runs.parent:
            return
        children = self.tracker.client.search_runs(
            [self.tracker.experiment_id],
            filter_string=f"tags.`mlflow.parentRunId` = '{self.runs.parent}'",
            max_results=5000,
        )
        for run in children:
            trial_id = run.data.tags.get("prvrlab.trial_id")
            if not trial_id or trial_id in self.runs.trials:  # a mapped run's trial is in the map
                continue
            self.runs.trials[trial_id] = run.info.run_id
            status = run.info.status
            if status in ("FINISHED", "FAILED"):  # ended: replayed, never reopened or run again
                self.runs.closed[trial_id] = status
            elif trial_id not in known:  # a KILLED one was closed by the dead driver's sentinel
                self.tracker.close_abandoned(run.info.run_id, lost, retag_killed=True)
                self.runs.closed[trial_id] = "KILLED"
            self._save()

    def close_all(self, trials, interrupted: bool = False) -> None:
        """Close every still-open child run according to its trial's state."""
        by_id = {t.trial_id: t for t in trials}
        for trial_id in list(self.runs.trials):
            if self.runs.closed.get(trial_id) in ("FINISHED", "FAILED"):
                continue
            trial = by_id.get(trial_id)
            if trial is None:
                if interrupted and self.runs.closed.get(trial_id) is None:
                    self.close_id(trial_id, "KILLED", {"prvrlab.status": "killed", "prvrlab.stop_reason": "interrupted"})
                continue
            status = getattr(trial, "status", "")
            if status == "TERMINATED":
                self._complete(trial)
            elif status == "ERROR":
                self._error(trial)
            elif trial_id in self._open or self.runs.closed.get(trial_id) is None:
                reason = "interrupted" if interrupted else "not finished when the study ended"
                self.close(trial, "KILLED", {"prvrlab.status": "killed", "prvrlab.stop_reason": reason})

    def _complete(self, trial) -> None:
        outcome = trial_outcome(trial.last_result)
        interrupted = outcome == "early_stopped" and INTERRUPTED.is_set()
        cut = outcome == "early_stopped" and not interrupted and TIME_LIMIT.is_set()  # not ASHA's stop
        if not (interrupted or cut):  # recorded before the run closes: a killed driver never loses an ended trial
            write_outcome(self.study.trial_dir(trial.trial_id), trial.last_result)
        if interrupted:
            self.close(trial, "KILLED", {"prvrlab.status": "killed", "prvrlab.stop_reason": "interrupted"})
        elif cut:
            self.cut.add(trial.trial_id)
            self._log_best(trial)
            reason = time_limit_reason(self.study.time_limit_s)
            self.close(trial, "KILLED", {"prvrlab.status": "time_limited", "prvrlab.stop_reason": reason})
        elif outcome == "invalid":
            self.close(trial, "FAILED", {"prvrlab.status": "error", "error": str(trial.last_result.get("error", "invalid config"))})
        elif outcome == "error":
            self.close(trial, "FAILED", {"prvrlab.status": "error", "error": str(trial.last_result.get("error", "trial failed"))})
        elif outcome == "nonfinite":
            error = str(trial.last_result.get("error", "non-finite loss"))
            self.close(trial, "FAILED", {"prvrlab.status": "nonfinite", "error": error})
        elif outcome == "early_stopped":
            self._log_best(trial)
            self.close(trial, "FINISHED", {"prvrlab.status": "early_stopped", "prvrlab.early_stopped": "true"})
        else:
            self._log_best(trial)
            self.close(trial, "FINISHED", {"prvrlab.status": "finished", "prvrlab.early_stopped": "false"})

    def _log_best(self, trial) -> None:
        """``best/<metric>`` on the trial's run: the value the study ranks it by (Tune's best over all its
        reports, as :func:`tuning.best_trial` reads it), under the parent's key, so one column of the
        MLflow runs table sorts the trials as the study did (its ``best/sumr`` is the best epoch's SumR,
        which picks the checkpoint and the ``final/*`` metrics)."""
        run_id = self.runs.trials.get(trial.trial_id)
        if run_id is None or self.runs.closed.get(trial.trial_id) in ("FINISHED", "FAILED"):
            return  # no run to write to, or a replayed outcome: already logged
        analysis = getattr(trial, "metric_analysis", None)
        if not analysis:  # no result was analysed: nothing to log
            return
        value = analysis.get(self.study.metric, {}).get(self.study.mode)
        if value is not None and math.isfinite(value):
            self.tracker.log_metrics(run_id, {f"best/{self.study.metric}": float(value)})

    def _error(self, trial) -> None:
        if self.runs.closed.get(trial.trial_id) not in ("FINISHED", "FAILED"):
            failure = self._record_error(trial)
            self.close(trial, "FAILED", {"prvrlab.status": "error", "error": failure.summary})

    def _record_error(self, trial):
        """Append the trial's last error to its ``error.txt``; returns its plain explanation."""
        text, failure = trial_error(trial)
        if text:
            attempt = int(getattr(getattr(trial, "run_metadata", None), "num_failures", 0) or 0)
            record_failure(self.study.trial_dir(trial.trial_id) / ERROR_FILE, text, failure, attempt=max(attempt, 1))
        return failure

    # ------------------------------------------------------------ Tune hooks

    def on_step_begin(self, iteration, trials, **info) -> None:
        """Keep Ctrl-C observable (Tune installs its own SIGINT handler when the run starts); at the
        first step of a resumed study, close the runs of trials its saved state lost and repoint the
        trials whose saved checkpoint is gone (before any trial restores from it)."""
        watch_interrupts()
        if not self._lost_checked:
            self._lost_checked = True
            self.close_lost(trials)
            self._repaired = repair_checkpoints(trials)

    def on_trial_start(self, iteration, trials, trial, **info) -> None:
        """Create (or reattach to) the trial's child run."""
        self._child_run(trial)

    def on_trial_restore(self, iteration, trials, trial, **info) -> None:
        """A restored trial keeps its run."""
        self._child_run(trial)

    def on_trial_result(self, iteration, trials, trial, result, **info) -> None:
        """Log one report: an epoch as a step, the final round as ``final/*``."""
        run_id = self._child_run(trial)
        if self.runs.closed.get(trial.trial_id) in ("FINISHED", "FAILED"):
            return  # a replayed outcome: already logged
        kind = result.get("kind")
        metrics = {k: v for k, v in result.items() if "/" in k or k in ("lr", "epoch")}
        if kind == "epoch":
            self.tracker.log_metrics(run_id, metrics, step=int(result["epoch"]))
        elif kind == "final":  # a value filled in for Tune only is no evaluation of the best model: not final/*
            filled = result.get(FILLED_KEY)
            self.tracker.log_metrics(run_id, {f"final/{k}": v for k, v in metrics.items() if k != filled})
            self.tracker.log_metrics(run_id, *best_point(metrics))
        elif kind == "nonfinite":
            self.tracker.set_tags(run_id, {"error": str(result.get("error", "non-finite loss"))})

    def on_trial_recover(self, iteration, trials, trial, **info) -> None:
        """A crashed trial is retried from its checkpoint: count it on the run."""
        run_id = self._child_run(trial)
        failure = self._record_error(trial)
        self.tracker.set_tags(run_id, {"prvrlab.retries": str(trial.run_metadata.num_failures), "prvrlab.last_failure": failure.summary})

    def on_trial_complete(self, iteration, trials, trial, **info) -> None:
        """Close the run FINISHED (full budget or early-stopped) or FAILED (non-finite)."""
        self._complete(trial)

    def on_trial_error(self, iteration, trials, trial, **info) -> None:
        """Close the run FAILED with the error."""
        self._error(trial)

    def on_experiment_end(self, trials, **info) -> None:
        """Close whatever is still open."""
        self.close_all(trials)
