"""Hyperparameter searches: Optuna samples, Ray Tune runs the trials (see :mod:`.study`)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Callable

from ray.tune.search.optuna import OptunaSearch

from prvrlab.files import write_text_atomically
from prvrlab.platform import storage
from prvrlab.platform.failures import interrupts_unwrapped
from prvrlab.platform.ray_logs import ray_logs_to
from prvrlab.platform.search.outcome import FAILED_OUTCOMES, TIME_LIMIT, RunMap, format_params, trial_outcome
from prvrlab.platform.search.resumable import RestoredTrial, resumable
from prvrlab.platform.search.spec import SearchSpec
from prvrlab.uris import redact_credentials
from prvrlab.platform.search.study import (
    STUDY_LOG,
    TIME_LIMIT_META,
    StudyContext,
    StudyResult,
    check_cluster,
    count_outcomes,
    killed_trials,
    make_study,
    open_parent,
    parent_status,
    prepare_environment,
    prepare_study,
    run_study,
    runs_for,
    tag_study_error,
)


# ---------------------------------------------------------------- search


def best_trial(trials, study: StudyContext | SearchSpec, killed: set[str] = frozenset()) -> dict[str, Any] | None:
    """The trial with the best value of the metric over all its reports (failed ones and those
    ended by an interrupt, ``killed``, excluded)."""
    better = (lambda a, b: a > b) if study.mode == "max" else (lambda a, b: a < b)
    best = None
    for t in trials:
        if t.status != "TERMINATED" or t.trial_id in killed or trial_outcome(t.last_result) in FAILED_OUTCOMES:
            continue
        value = t.metric_analysis.get(study.metric, {}).get(study.mode)
        if value is None or not math.isfinite(value):
            continue
        if best is None or better(value, best["value"]):
            best = {"trial_id": t.trial_id, "value": float(value), "config": dict(t.config)}
    return best


def write_best_config(study: StudyContext, best: dict[str, Any], spec: SearchSpec) -> Path:
    """``<study dir>/best_config.yaml``: the best trial's config, ready for ``prvrlab train``."""
    cfg = study.experiment_config(best["config"])
    cfg = dataclasses.replace(cfg, name=f"{spec.name}_best", tracking=dataclasses.replace(cfg.tracking, run_name=None))
    header = (
        f"# best trial {best['trial_id']} of search '{spec.name}' ({spec.metric} {best['value']:.3f}, mode {spec.mode})\n"
        f"# searched values: {format_params(best['config'])}\n"
        f"# the spec's overrides are included: {format_params(spec.overrides) or 'none'}\n"
    )
    path = Path(study.study_dir) / "best_config.yaml"
    write_text_atomically(path, header + cfg.to_yaml())
    return path


class TolerantOptunaSearch(OptunaSearch):
    """OptunaSearch that skips rounds without the metric (non-finite, final-without-metric) and
    reports of trials its restored state never asked for (see :mod:`.resumable`)."""

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        """Report an intermediate value to Optuna only when the round has one."""
        if self.metric in result and trial_id in self._ot_trials:
            super().on_trial_result(trial_id, result)

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        """Tell Optuna the outcome of a trial it asked for."""
        if trial_id in self._ot_trials:
            super().on_trial_complete(trial_id, result=result, error=error)

    def forget_lost(self, trials: dict[str, RestoredTrial]) -> None:
        """Close FAIL the Optuna trials asked for trials Tune's restored state does not hold
        (their slots are sampled again): they would otherwise stay RUNNING in the Optuna study.

        A grid sampler counts a failed point as visited and never hands it out again, so there the lost
        trial's point is queued for the next suggestion (with its grid id, so the sampler counts it once it
        ends): the grid is still trained in full. Telling a grid sampler its last point ended makes it stop
        the study, which Optuna allows only inside ``optimize``: that stop is ignored here (Tune's budget ends
        the search), the trial is closed all the same."""
        import optuna

        grid = isinstance(self._ot_study.sampler, optuna.samplers.GridSampler)
        for trial_id in sorted(set(self._ot_trials) - set(trials) - set(self._completed_trials)):
            ot_trial = self._ot_trials.pop(trial_id)
            frozen = next(t for t in self._ot_study.get_trials(deepcopy=False) if t.number == ot_trial.number)
            try:
                self._ot_study.tell(ot_trial, state=optuna.trial.TrialState.FAIL)
            except RuntimeError:  # GridSampler.after_trial -> Study.stop() outside optimize; the trial is closed
                if not grid:
                    raise
            if grid and frozen.params:
                point = {k: frozen.system_attrs[k] for k in ("grid_id", "search_space") if k in frozen.system_attrs}
                self._ot_study.add_trial(optuna.trial.create_trial(
                    state=optuna.trial.TrialState.WAITING, system_attrs={"fixed_params": dict(frozen.params), **point}))


def ended_trials(study_dir: Path, total: int) -> list[Any] | None:
    """A local study's Tune trials when a resume would have nothing to run: all ``total`` of them created and
    ended (finished, or failed: a resume does not retry those), and each one's MLflow run closed by the driver
    FINISHED or FAILED; read from Tune's saved state without Ray.  None otherwise, or when the state cannot be
    read (Tune then decides)."""
    from ray.tune import ExperimentAnalysis

    tune_path = Path(study_dir) / "tune"
    if not tune_path.is_dir():
        return None
    try:
        with ray_logs_to(Path(study_dir) / STUDY_LOG):  # Tune's warnings (a trial with no results yet): off the console
            trials = ExperimentAnalysis(str(tune_path)).trials
    except Exception:  # noqa: BLE001 - an unreadable state is Tune's to report, on the usual path
        return None
    if len(trials) < total or any(t.status not in ("TERMINATED", "ERROR") for t in trials):
        return None
    closed = RunMap(study_dir).closed  # each trial's MLflow run as the driver closed it
    if any(closed.get(t.trial_id) not in ("FINISHED", "FAILED") for t in trials):
        return None  # closed KILLED by an interrupt, or not by the driver (killed first): Tune's path decides
    return trials


def _searcher(spec: SearchSpec):
    """OptunaSearch (seeded sampler, define-by-run space) that tolerates rounds without the metric,
    limited to the spec's concurrent slots, in a generator that restores consistently.

    A non-finite round carries no metric value: it is not reported to Optuna
    (stock OptunaSearch would raise), and the trial ends up PRUNED there.
    """
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if spec.sampler == "grid":
        sampler = optuna.samplers.GridSampler(spec.grid(), seed=spec.seed)
    elif spec.sampler == "random":
        sampler = optuna.samplers.RandomSampler(seed=spec.seed)
    else:
        sampler = optuna.samplers.TPESampler(seed=spec.seed)
    searcher = TolerantOptunaSearch(space=spec.define_by_run(), metric=spec.metric, mode=spec.mode, sampler=sampler, seed=spec.seed)
    return resumable(searcher, spec.slots)


def search(spec: SearchSpec, *, resume: bool = False, echo: Callable[[str], None] | None = print) -> StudyResult:
    """Run (or resume) a hyperparameter search; returns the study's outcome (``echo=None``: silent)."""
    progress = echo is not None
    echo = echo or (lambda _: None)
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    from prvrlab.platform.search.time_limit import TimeLimit, time_limit_reason

    from prvrlab.platform.tracking.store import Tracker
    from prvrlab.platform.runtime import check_joinable, ensure_ray
    from prvrlab.platform.study_state import release_studies

    check_cluster(spec)  # impossible resources: refused before the study folder and parent run exist
    check_joinable()  # as is a RAY_ADDRESS nothing answers at
    base, study_dir, resumed = prepare_study(spec, resume=resume, kind="search", echo=echo)
    tracker = Tracker(base.tracking.uri, base.tracking.experiment)
    runs = RunMap(study_dir)
    parent = open_parent(tracker, runs, spec, "search", study_dir)
    status = "FAILED"
    try:
        with interrupts_unwrapped():  # an interrupt wrapped by other code still ends the parent KILLED
            ended = ended_trials(study_dir, spec.trials) if resumed and not storage.is_remote(base.tracking.storage_path) else None
            if ended is not None:  # nothing left to run: no Ray, the outcome as the first submission recorded it
                best = best_trial(ended, spec)  # none was closed KILLED (ended_trials)
                written = study_dir / "best_config.yaml"
                if best is None or written.is_file():
                    echo(f"search '{spec.name}': all {len(ended)} trials have ended; nothing left to resume")
                    result, status = _search_outcome(tracker, spec, study_dir, parent, ended, set(), best, written, interrupted=False)
                    return result
            prepare_environment()
            ensure_ray(echo=echo)
            study = make_study(spec, "search", base, study_dir)
            echo(
                f"search '{spec.name}': {spec.trials} trials, {spec.slots} at a time, "
                f"{study.workers} worker(s) x {study.cpus_per_worker:g} CPU"
                + (f" + {study.gpus_per_worker:g} GPU" if study.gpus_per_worker else "")
                + study.ranks_note()
                + f"; MLflow parent run {parent} ({redact_credentials(tracker.uri)}); folder {study_dir}"
            )
            searcher = _searcher(spec)
            if spec.scheduler == "asha":
                scheduler = ASHAScheduler(
                    time_attr="training_iteration",
                    max_t=spec.base.train.epochs + 1,  # the last round is the final evaluation
                    grace_period=spec.grace_period,
                    reduction_factor=spec.reduction_factor,
                    stop_last_trials=False,
                )
            else:
                scheduler = FIFOScheduler()
            results, mlflow_cb, interrupted = run_study(
                spec,
                study,
                tune_config_kwargs={
                    "search_alg": searcher,
                    "scheduler": scheduler,
                    "num_samples": spec.trials,
                },
                param_space={},
                resume=resumed,
                tracker=tracker,
                total=spec.trials,
                progress=progress,
                echo=echo,
                stop=None if spec.time_limit_s is None else TimeLimit(spec.time_limit_s),
            )
            trials = list(getattr(results, "_experiment_analysis").trials) if results is not None else []
            if TIME_LIMIT.is_set() and not interrupted:  # recorded: a resume would have no time left
                reason = f"{time_limit_reason(spec.time_limit_s)}: {len(mlflow_cb.runs.trials)} of {spec.trials} trials started"
                mlflow_cb.runs.meta[TIME_LIMIT_META] = spec.time_limit_s
                mlflow_cb.runs.save()
                mlflow_cb.mirror.push()
                tracker.set_tags(parent, {"prvrlab.stop_reason": reason})
                echo(f"search '{spec.name}': {reason}")
            killed = killed_trials(study_dir)
            best = best_trial(trials, study, killed - mlflow_cb.cut)  # a cut trial's reports count, as ASHA's stops
            path = None
            if best is not None:
                path = write_best_config(study, best, spec)
                study.push_files().push()  # object store: best_config.yaml beside the study
            result, status = _search_outcome(tracker, spec, study_dir, parent, trials, killed, best, path, interrupted=interrupted)
            return result
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    except Exception as exc:
        tag_study_error(tracker, parent, exc)
        raise
    finally:
        tracker.end_run(parent, status)
        release_studies()  # this driver's lock of the study (taken with its folder)


def _search_outcome(tracker, spec: SearchSpec, study_dir: Path, parent: str, trials, killed: set[str],
                    best: dict[str, Any] | None, path: Path | None, *, interrupted: bool) -> tuple[StudyResult, str]:
    """Record a search's outcome on its parent run (trial counts, the best trial, ``best_config.yaml`` at
    ``path``); returns it and the MLflow status the caller ends the parent run with."""
    counts = count_outcomes(trials, killed)
    summary = {f"trials/{k}": v for k, v in counts.items()}
    if best is not None:
        best["path"] = path
        summary[f"best/{spec.metric}"] = best["value"]
        tracker.set_tags(parent, {"prvrlab.best_trial": best["trial_id"], "prvrlab.best_run": runs_for(study_dir).get(best["trial_id"], "")})
        tracker.log_artifacts(parent, [path])
    tracker.log_metrics(parent, summary)
    complete = counts["failed"] + counts["unfinished"] == 0
    status = parent_status(tracker, parent, interrupted=interrupted, ok=best is not None, complete=complete)
    return StudyResult(study_dir, parent, counts, best, interrupted), status


