"""Ablation studies: every variant x seed of a spec as one Tune study.

Each cell is a trial, handed out in order by a :class:`~.resumable.ListSearcher`.
Child runs carry ``prvrlab.variant``, ``prvrlab.seed``, ``components`` and
``config_hash``; resubmitting the spec
reuses the study's parent run, closes child runs a killed driver left RUNNING
as KILLED, and skips every cell whose config hash already has a FINISHED child
run of this study in the experiment.  Each submission tags the parent with its
cells' config hashes (``prvrlab.cell_hash.<cell>``): its summary and the
report count only the runs of those configs, not those of an earlier
submission with another base config, ``--set`` or default; every child run
of the study is tagged ``prvrlab.superseded`` ``true`` when its config is
none of the latest submission's cells (``false`` otherwise), so the MLflow UI
can hide them (``tags.prvrlab.superseded = 'false'``).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Callable

from prvrlab.platform.failures import interrupts_unwrapped
from prvrlab.platform.search.outcome import STUDY_FILE, RunMap
from prvrlab.platform.search.study import (
    SUPERSEDED_TAG,
    StudyResult,
    check_cluster,
    make_study,
    open_parent,
    parent_status,
    prepare_study,
    run_study,
    study_location,
    study_root,
    prepare_environment,
    tag_study_error,
)
from prvrlab.platform.search.spec import CELL_HASH_TAG, AblationSpec
from prvrlab.platform.tracking.drivers import driver_alive, driver_tags
from prvrlab.uris import redact_credentials



def study_children(tracker, name: str, status: str | None = None) -> list:
    """The child runs of ablation ``name`` in the tracker's experiment (only those in ``status``, e.g.
    ``FINISHED``, when given)."""
    where = f"tags.`prvrlab.study` = '{name}' and tags.`prvrlab.study_kind` = 'ablation'"
    if status is not None:
        where += f" and attributes.status = '{status}'"
    return tracker.client.search_runs([tracker.experiment_id], filter_string=where, max_results=5000)


def finished_hashes(tracker, name: str) -> dict[str, str]:
    """config hash -> run id of this ablation's FINISHED (full-budget) child runs."""
    runs = study_children(tracker, name, "FINISHED")
    return {
        r.data.tags["config_hash"]: r.info.run_id
        for r in runs
        if r.data.tags.get("prvrlab.status") == "finished" and "config_hash" in r.data.tags
    }


def mark_superseded(tracker, name: str, current: set[str]) -> None:
    """Tag each child run of ablation ``name`` :data:`SUPERSEDED_TAG` ``true`` when its config hash is none
    of ``current`` (the latest submission's cells; a run without a config hash too), else ``false``."""
    found = study_children(tracker, name)
    for run in found:
        value = "false" if run.data.tags.get("config_hash") in current else "true"
        if run.data.tags.get(SUPERSEDED_TAG) != value:
            tracker.set_tags(run.info.run_id, {SUPERSEDED_TAG: value})


def close_orphans(tracker, name: str, runs: RunMap) -> list[str]:
    """Close as KILLED this ablation's child runs left RUNNING by a driver that died (every RUNNING
    child run the current study does not own and no other live process on this host drives); their cells
    then count as not finished and run again."""
    found = study_children(tracker, name, "RUNNING")
    own, me = set(runs.trials.values()), driver_tags()
    orphans = []
    for run in found:
        tags = run.data.tags
        if run.info.run_id in own or (driver_alive(tags) and any(tags.get(k) != v for k, v in me.items())):
            continue  # the study's own, or another live process's
        if tracker.close_abandoned(run.info.run_id, {"prvrlab.status": "killed", "prvrlab.stop_reason": "orphaned: its driver died"}):
            orphans.append(run.info.run_id)  # (not when its driver's sentinel closed it meanwhile)
    return orphans


def summarise(tracker, name: str, metric: str, hashes: dict[str, str], spec: AblationSpec) -> dict[str, tuple[float, float, int]]:
    """variant -> (mean, std, n) of ``final/<metric>`` (else ``<metric>``) over finished seeds, counting for
    each cell only a run of its config (``hashes``: cell -> config hash)."""
    runs = study_children(tracker, name, "FINISHED")
    values: dict[str, list[float]] = {v: [] for v in spec.variants}
    seen: set[str] = set()
    for r in runs:
        cell = r.data.tags.get("prvrlab.cell")
        if r.data.tags.get("prvrlab.status") != "finished" or cell not in hashes or cell in seen:
            continue
        if r.data.tags.get("config_hash") != hashes[cell]:  # another submission's config of this cell
            continue
        value = r.data.metrics.get(f"final/{metric}", r.data.metrics.get(metric))
        if value is not None and math.isfinite(value):
            seen.add(cell)
            values[spec.cell_labels(cell)[0]].append(value)
    return {
        v: (statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0, len(xs))
        for v, xs in values.items()
        if xs
    }


def ablate(spec: AblationSpec, *, resume: bool = False, echo: Callable[[str], None] | None = print) -> StudyResult:
    """Run (or resume) an ablation; cells already finished in MLflow are skipped (``echo=None``: silent)."""
    progress = echo is not None
    echo = echo or (lambda _: None)
    from prvrlab.platform.search.resumable import ListSearcher, resumable
    from prvrlab.platform.search.study import StudyContext
    from prvrlab.platform.tracking.store import Tracker
    from prvrlab.platform.runtime import check_joinable, ensure_ray
    from prvrlab.platform.study_state import release_studies

    check_cluster(spec)  # impossible resources: refused before the study folder and parent run exist
    check_joinable()  # as is a RAY_ADDRESS nothing answers at
    base, study_dir, resumed = prepare_study(spec, resume=resume, kind="ablation", echo=echo)
    tracker = Tracker(base.tracking.uri, base.tracking.experiment)
    runs = RunMap(study_dir)
    all_cells = spec.cells()
    orphans = close_orphans(tracker, spec.name, runs)
    if orphans:
        echo(f"closed {len(orphans)} child run(s) left RUNNING by a driver that died, as KILLED; their cells run again")
    done = finished_hashes(tracker, spec.name)
    plain = StudyContext(
        kind="ablation", name=spec.name, study_dir=str(study_dir), base_raw=base.to_dict(), metric=spec.metric,
        mode=spec.mode, workers=spec.resources.workers_per_trial, cpus_per_worker=1.0,
        gpus_per_worker=spec.resources.gpus_per_worker, tracking_uri=base.tracking.uri,
        experiment=base.tracking.experiment, cells=all_cells,
    )
    hashes = {c: plain.experiment_config({"cell": c}).fingerprint() for c in all_cells}
    todo = {c: o for c, o in all_cells.items() if hashes[c] not in done}
    skipped = len(all_cells) - len(todo)
    root = study_root(base.tracking.storage_path, "ablation", spec.name)
    study_location(base.tracking.storage_path, "ablation", spec.name).pull(include=(STUDY_FILE,))  # object store: earlier parents
    parent = open_parent(tracker, runs, spec, "ablation", study_dir, parent_run_id=None if resumed else previous_parent_excluding(root, study_dir))
    status = "FAILED"
    interrupted = False
    try:  # from here on every way out ends the parent (FAILED with the error, KILLED on an interrupt)
        tracker.set_tags(parent, {f"{CELL_HASH_TAG}{c}": h for c, h in hashes.items()})
        echo(
            f"ablation '{spec.name}': {len(spec.variants)} variants x {len(spec.seeds)} seeds = {len(all_cells)} cells, "
            f"{skipped} already finished; MLflow parent run {parent} ({redact_credentials(tracker.uri)}); folder {study_dir}"
        )
        mark_superseded(tracker, spec.name, set(hashes.values()))
        with interrupts_unwrapped():  # an interrupt wrapped by other code still ends the parent KILLED
            if not todo and resumed:  # Tune would only restore trials whose cells have finished since: no Ray
                echo(f"ablation '{spec.name}': every cell has finished; nothing left to resume")
            if todo:
                prepare_environment()
                ensure_ray(echo=echo)
                study = make_study(spec, "ablation", base, study_dir, cells=all_cells, resolved=plain.resolved)
                note = study.ranks_note()
                if note:
                    echo(f"ablation '{spec.name}': {study.workers} workers per cell{note}")
                cells = [{"cell": c} for c in sorted(todo, key=list(all_cells).index)]
                _, _, interrupted = run_study(
                    spec,
                    study,
                    tune_config_kwargs={"num_samples": len(todo), "search_alg": resumable(ListSearcher(cells), spec.slots)},
                    param_space={},
                    resume=resumed,
                    tracker=tracker,
                    total=len(todo),
                    progress=progress,
                    echo=echo,
                )
            summary = summarise(tracker, spec.name, spec.metric, hashes, spec)
            counts = _cell_counts(tracker, spec.name, hashes)
            metrics: dict[str, float] = {f"cells/{k}": v for k, v in counts.items()}
            if summary:
                echo(f"{'variant':<24} {spec.metric + ' mean':>16} {'std':>8} {'seeds':>6}")
                for variant, (mean, std, n) in summary.items():
                    spread = f"{std:8.2f}" if n > 1 else f"{'—':>8}"  # one seed: no spread
                    echo(f"{variant:<24} {mean:16.2f} {spread} {n:6d}")
                    metrics[f"variant/{variant}/mean"] = mean
                    metrics[f"variant/{variant}/std"] = std
            tracker.log_metrics(parent, metrics)
            complete = counts["failed"] + counts["missing"] == 0
            status = parent_status(tracker, parent, interrupted=interrupted, ok=counts["finished"] > 0, complete=complete)
            return StudyResult(study_dir, parent, counts, None, interrupted)
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    except Exception as exc:
        tag_study_error(tracker, parent, exc)
        raise
    finally:
        tracker.end_run(parent, status)
        release_studies()  # this driver's lock of the study (taken with its folder)


def previous_parent_excluding(root: Path, current: Path) -> str | None:
    """The parent run of an earlier submission (not ``current``), to keep one parent per ablation."""
    if not root.is_dir():
        return None
    for folder in sorted((d for d in root.iterdir() if d.is_dir() and d != current), reverse=True):
        parent = RunMap(folder).parent
        if parent:
            return parent
    return None


def _cell_counts(tracker, name: str, hashes: dict[str, str]) -> dict[str, int]:
    """finished / failed / missing cells of the whole ablation (over all submissions, each cell's runs of its
    config only: ``hashes``, cell -> config hash)."""
    runs = study_children(tracker, name)
    runs = [r for r in runs if hashes.get(r.data.tags.get("prvrlab.cell", "")) == r.data.tags.get("config_hash")]
    finished = {r.data.tags.get("prvrlab.cell") for r in runs if r.data.tags.get("prvrlab.status") == "finished" and r.info.status == "FINISHED"}
    failed = {r.data.tags.get("prvrlab.cell") for r in runs if r.info.status == "FAILED"} - finished
    return {"finished": len(finished), "failed": len(failed), "missing": len(hashes) - len(finished) - len(failed)}
