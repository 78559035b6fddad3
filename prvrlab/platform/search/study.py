"""Searches and ablations on Ray Tune: one trial = one training run.

The driver validates the spec, prepares the data once, starts (or joins)
Ray and runs a Tune experiment whose function trainable :func:`run_trial`
trains one config:

- one worker per trial: ``train_worker`` runs inside the trial actor itself
  (a :class:`TuneSession`; the actor holds the worker's CPUs/GPU share and
  is reused between trials), which skips a Train worker group's start; with
  ``resources.reuse_workers: true`` on a one-rank pool instead, whose rank (a
  spare the driver starts with the study) imports torch while Tune starts the
  trial actor;
- several workers: the trial fits a Ray Train ``TorchTrainer`` (DDP) named
  after the trial id, so a retried trial resumes from its checkpoint; the
  trial actor itself asks for 0.01 CPU; with ``resources.reuse_workers`` (by
  default for CPU ranks on a one-node cluster: :func:`pooled_ranks`) the trial
  actor (reused between trials) trains on its slot's long-lived DDP ranks
  instead (:mod:`prvrlab.platform.search.workers`).

Only the driver writes to MLflow (:class:`MlflowStudyCallback`); the study
folder ``<storage>/<kind>/<name>/<stamp>/`` holds Tune's state (``tune/``),
Train runs (``train/``), per-trial files (``trials/<id>/files``, with
``error.txt`` for a failed trial), the run map (``study.json``), Ray's and
Tune's log lines (``study.log``) and, for a search, ``best_config.yaml``.
On an object store (``tracking.storage_path: s3://...``) Tune and Train write
there directly; the other files live in the study's local staging folder and
are pushed by the driver every few seconds and at the end, a trial's model and
ranks by its rank 0, and ``--resume`` pulls them first
(:mod:`prvrlab.platform.storage`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import signal
import stat
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from prvrlab.files import leading_comments, write_text_atomically
from prvrlab.platform import storage
from prvrlab.platform.config import ConfigError, ExperimentConfig, apply_overrides, loss_tokens, plugin_tokens, read_yaml, validate
from prvrlab.platform.ray_logs import ray_logs_to
from prvrlab.platform.resources import local_cluster, shortfall
from prvrlab.platform.failures import ERROR_FILE, STUDY_HINT, explain_exception, failure_text, record_failure
from prvrlab.platform.search.mlflow_callback import MlflowStudyCallback
from prvrlab.platform.search.outcome import (
    FAILED_OUTCOMES,
    FILLED_KEY,
    INTERRUPTED,
    OUTCOME_FILE,
    STUDY_FILE,
    TIME_LIMIT,
    RunMap,
    format_params,
    read_outcome,
    trial_outcome,
)
from prvrlab.platform.search.spec import StudyError, StudySpec
from prvrlab.platform.tracking import closer
from prvrlab.platform.study_state import (
    STATE_SUMS,
    TRUST_STATE_ENV,
    claim_study,
    forget_state,
    forget_writers,
    read_sums,
    record_state,
    register_writer,
    state_record,
    state_sums,
)
from prvrlab.platform.tracking.drivers import driver_tags

TRIAL_ACTOR_CPU = 0.01  # the Tune actor of a multi-worker trial only waits on its TorchTrainer
STUDY_LOG = "study.log"  # Ray's and Tune's log lines and Python warnings of every submission
DRIVER_PUSH_EXCLUDE = ("tune", "train", *storage.WORKER_FILES)  # written to the store by Tune, Train and rank 0
SYNC_S = 2.0  # the driver pushes the study's files this often (as often as Tune saves its state)
NODES_FILE = "nodes.txt"  # per trial: the Ray node of the trial actor / each Train rank, one line per attempt
WORKER_GROUP_START_TIMEOUT = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"  # Ray Train V2 (2.60) reads it


SUPERSEDED_TAG = "prvrlab.superseded"  # an ablation's child run: "true" when no cell of the latest submission has its config
TIME_LIMIT_META = "time_limit_reached"  # study.json: the budget.time_limit_s (s) that stopped the search
NOW_TAG = "prvrlab.now."  # + a parent's param: its value in the latest submission, where that differs from the logged one
FIRST_COMMIT_TAG = "prvrlab.first_git_commit"  # on a parent a later submission continued with other code: the first one's


def _components(cfg: ExperimentConfig) -> str:
    """Backbone, plug-ins and loss terms of non-zero weight (generic, from the config)."""
    parts = [f"backbone:{cfg.backbone}"]
    parts += [f"plugin:{p}" for p in plugin_tokens(cfg)]
    parts += [f"loss:{t}" for t in loss_tokens(cfg)]
    return ",".join(parts)


@dataclass
class StudyContext:
    """Everything a trial and the driver callbacks need (plain data, picklable)."""

    kind: str  # "search" | "ablation"
    name: str
    study_dir: str
    base_raw: dict[str, Any]  # resolved base config (absolute paths) with the spec's overrides
    metric: str
    mode: str
    workers: int
    cpus_per_worker: float
    gpus_per_worker: float
    tracking_uri: str
    experiment: str
    cells: dict[str, dict[str, Any]] | None = None  # ablation: cell -> overrides
    fault: dict[str, Any] | None = None  # test hook forwarded to the workers
    short_keys: dict[str, str] = field(default_factory=dict)  # search: space key -> its short form in run names
    trial_digits: int = 1  # search: trial numbers in run names are zero-padded to the width of the trial count
    admission: str | None = None  # multi-worker trials: the name of the study's admission ledger actor
    placement_timeout_s: float = 60.0  # how long a worker group, or with none running a trial, may wait to be placed
    resolved: dict[str, ExperimentConfig] = field(default_factory=dict, repr=False)  # overrides JSON -> config
    reuse_workers: bool = False  # trials train on their slot's long-lived pool (search/workers.py)
    storage: str = ""  # the study folder's object-store URI; "" when study_dir is the folder itself
    driver: dict[str, str] = field(default_factory=dict)  # the driver process (drivers.driver_tags): trials register as its writers
    time_limit_s: float | None = None  # search: budget.time_limit_s, named where it cut a trial

    def ranks_note(self) -> str:
        """How a multi-worker trial gets its DDP ranks, for the study's first console line ("" for one
        worker): a worker group started per trial costs seconds a trial that reused ranks do not."""
        if self.workers < 2:
            return ""
        if self.reuse_workers:
            return "; DDP ranks kept across trials"
        return "; a worker group started per trial (resources.reuse_workers: true keeps the ranks across trials)"

    def overrides(self, config: dict[str, Any]) -> dict[str, Any]:
        """The dotted overrides a trial config stands for."""
        if self.cells is not None:
            return dict(self.cells[config["cell"]])
        return {k: v for k, v in config.items()}

    def experiment_config(
        self, config: dict[str, Any], *, check: Callable[[dict[str, Any]], ExperimentConfig] = validate
    ) -> ExperimentConfig:
        """The trial's validated, resolved experiment config (validated by ``check`` once per process and
        trial config; an ablation's cells are all resolved by the driver before Ray starts)."""
        key = json.dumps(self.overrides(config), sort_keys=True, default=str)
        cache = self.resolved
        if key not in cache:
            raw = apply_overrides(self.base_raw, self.overrides(config))
            raw = apply_overrides(raw, {"train.num_workers": self.workers, "train.use_gpu": self.gpus_per_worker > 0})
            cache[key] = check(raw)
        return cache[key]

    def trial_dir(self, trial_id: str) -> Path:
        """Where a trial writes its run files."""
        return Path(self.study_dir) / "trials" / trial_id / "files"

    def trial_sync(self, trial_id: str) -> str | None:
        """The object-store URI a trial's files are pushed to (None for local storage)."""
        return f"{self.storage}/trials/{trial_id}/files" if self.storage else None

    def where(self, sub: str) -> str:
        """Where Ray writes ``sub`` (``tune``, ``train``): the object-store URI or the local folder."""
        return f"{self.storage}/{sub}" if self.storage else str(Path(self.study_dir) / sub)

    def push_files(self) -> storage.Mirror:
        """A mirror pushing the driver's study files to the object store (a no-op one for local storage)."""
        return storage.Mirror(self.study_dir, self.storage or None, exclude=DRIVER_PUSH_EXCLUDE, last=(STUDY_FILE,))

    def trial_progress(self, trial) -> dict[str, Any] | None:
        """The in-epoch progress rank 0 of ``trial`` last wrote, or None."""
        from prvrlab.platform.train.live import PROGRESS_FILE, read_progress

        return read_progress(self.trial_dir(trial.trial_id) / PROGRESS_FILE)

    def trial_ended(self, trial) -> bool:
        """Whether ``trial`` ended (FINISHED or FAILED) in an earlier driver: its outcome is recorded."""
        return read_outcome(self.trial_dir(trial.trial_id)) is not None

    def label(self, config: dict[str, Any]) -> str:
        """A short description of a trial for the progress view."""
        if self.cells is not None:
            return str(config["cell"])
        return format_params(config)

    def cell(self, config: dict[str, Any]) -> tuple[str, int]:
        """An ablation trial's (variant, seed)."""
        variant, seed = str(config["cell"]).rsplit("/seed", 1)
        return variant, int(seed)

    def run_name(self, number: int, config: dict[str, Any]) -> str:
        """The MLflow name of a trial's child run: ``trial 3 · lr=3e-4 ...`` (``number``: the trial's
        1-based start order) or ``<variant> · seed 1``."""
        from prvrlab.platform.search.names import ablation_run_name, search_run_name

        if self.cells is not None:
            return ablation_run_name(*self.cell(config))
        return search_run_name(number, config, self.short_keys, digits=self.trial_digits)

    def trial_tags(self, config: dict[str, Any], cfg: ExperimentConfig, commit: str) -> dict[str, str]:
        """Tags of a trial's child run."""
        from prvrlab.platform.tracking.tags import run_tags

        tags = run_tags(cfg, commit)
        tags.update(
            {
                "prvrlab.kind": "trial",
                "prvrlab.study": self.name,
                "prvrlab.study_kind": self.kind,
                "backbone": cfg.backbone,
                "dataset": cfg.data.collection,
                "seed": str(cfg.train.seed),
                "prvrlab.seed": str(cfg.train.seed),
                "config_hash": cfg.fingerprint(),
                "components": _components(cfg),
                "plugins": ",".join(plugin_tokens(cfg)) or "none",
                "losses": ",".join(t for t, s in cfg.losses.items() if s["weight"] > 0),
            }
        )
        if self.cells is not None:
            tags["prvrlab.variant"] = self.cell(config)[0]
            tags["prvrlab.cell"] = str(config["cell"])
            tags[SUPERSEDED_TAG] = "false"  # a cell of the latest submission (ablation.mark_superseded)
        else:
            tags["prvrlab.sampled"] = format_params(config)
        return tags

    def invalid_tags(self, config: dict[str, Any], error: str, commit: str) -> dict[str, str]:
        """Tags of the child run of a trial whose sampled config does not validate (with the code's
        commit, as its sibling trials have: the UI's Version column)."""
        from prvrlab.platform.tracking.tags import provenance_tags

        tags = {"prvrlab.kind": "trial", "prvrlab.study": self.name, "prvrlab.study_kind": self.kind, "error": error,
                **provenance_tags(commit)}
        if self.cells is not None:
            tags["prvrlab.cell"] = str(config["cell"])
            tags[SUPERSEDED_TAG] = "false"
        else:
            tags["prvrlab.sampled"] = format_params(config)
        return tags


# ---------------------------------------------------------------- the trial


class MetricFiller:
    """Makes every report carry the searched metric where it is meaningful.

    The final round has no per-epoch value: it gets the best model's value, ``best/<name>``, or for a
    validation metric its value at the best epoch (``best/epoch``, the epoch that saved the best model);
    else the best value seen so far, which ``FILLED_KEY`` names (for Tune's ranking only: the child run's
    ``final/*`` holds the best model's values, not this).  Non-finite rounds are left without it
    (Optuna records such a trial as pruned).
    """

    def __init__(self, metric: str, mode: str) -> None:
        self.metric, self.mode = metric, mode
        self.by_epoch: dict[int, float] = {}  # epoch -> the metric's value reported then

    def __call__(self, metrics: dict[str, Any]) -> dict[str, Any]:
        kind = metrics.get("kind")
        value = metrics.get(self.metric)
        if kind == "epoch" and isinstance(value, (int, float)) and isinstance(metrics.get("epoch"), (int, float)):
            self.by_epoch[int(metrics["epoch"])] = float(value)
        if kind == "final" and self.metric not in metrics:
            own = metrics.get("best/" + self.metric.rsplit("/", 1)[-1])
            epoch = metrics.get("best/epoch")
            if own is None and self.metric.startswith("val/") and isinstance(epoch, (int, float)):
                own = self.by_epoch.get(int(epoch))  # the best model's validation, at the epoch that saved it
            if own is not None:
                metrics[self.metric] = own
            elif self.by_epoch:
                metrics[self.metric] = (max if self.mode == "max" else min)(self.by_epoch.values())
                metrics[FILLED_KEY] = self.metric
        return metrics


def _report_callback(filler: MetricFiller):
    """A Train callback forwarding rank 0's reports to Tune (with the metric filled in)."""
    from ray.tune.integration.ray_train import TuneReportCallback

    class FilledTuneReport(TuneReportCallback):
        def after_report(self, run_context, metrics, checkpoint):
            filled = [filler(dict(metrics[0]))] + list(metrics[1:])
            super().after_report(run_context, filled, checkpoint)

    return FilledTuneReport()


def run_trial(config: dict[str, Any], study: StudyContext, spares: list[list[Any]] | None = None) -> None:
    """Tune function trainable: train one config (in-actor for 1 worker, TorchTrainer DDP otherwise;
    ``spares``: the driver's pool ranks this trial actor may adopt)."""
    from ray import tune

    trial_id = tune.get_context().get_trial_id()
    if study.driver and not study.storage:  # a local study: its sentinel waits for this process (study_state)
        try:
            register_writer(Path(study.study_dir), study.driver)
        except OSError:  # unwritable: the sentinel falls back to waiting for the folder to go quiet
            pass
    check = validate
    if study.reuse_workers:  # the slot's pool starts now (or is adopted) and checks the config
        from prvrlab.platform.search.workers import offer, prestart, validate_on_pool

        offer(spares or [])
        prestart(study.workers, study.cpus_per_worker, study.gpus_per_worker)
        check = validate_on_pool
    try:
        cfg = study.experiment_config(config, check=check)
    except ConfigError as exc:  # an invalid sample: one failed trial, not a retried crash
        tune.report({"kind": "invalid", "error": str(exc)})
        return
    run_dir = study.trial_dir(trial_id)
    sync_to = study.trial_sync(trial_id)
    if sync_to:  # the outcome a driver recorded before it was killed, when this node has no copy
        storage.Location(sync_to).pull(include=(OUTCOME_FILE,))
    recorded = read_outcome(run_dir)
    if recorded is not None:  # ended before the driver stopped, restored as unfinished by Tune
        tune.report(recorded)
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomically(run_dir / "config.yaml", cfg.to_yaml())
    loop_config = {
        "experiment": cfg,
        "run_dir": str(run_dir),
        "cpus_per_worker": study.cpus_per_worker,
        "fault": study.fault,
        "sync_to": sync_to,
    }
    filler = MetricFiller(study.metric, study.mode)
    try:
        _train_trial(study, trial_id, loop_config, filler)
    except Exception as exc:
        failure = explain_exception(exc, hint=STUDY_HINT)
        if failure.retryable:  # Tune retries the trial from its checkpoint (max_retries)
            raise
        record_failure(run_dir / ERROR_FILE, failure_text(exc), failure, attempt=1)
        storage.Mirror(run_dir, sync_to).push()
        tune.report({"kind": "error", "error": failure.summary})  # the same error again: not retried


def _train_trial(study: StudyContext, trial_id: str, loop_config: dict[str, Any], filler: MetricFiller) -> None:
    """On the slot's pool with ``reuse_workers``; else in the trial actor for 1 worker, a TorchTrainer (DDP,
    resumed by its name) otherwise."""
    if study.workers == 1 and not study.reuse_workers:
        from prvrlab.platform.train.loop import train_worker
        from prvrlab.platform.train.session import TuneSession

        record_node(loop_config["run_dir"], "trial")
        train_worker(loop_config, TuneSession(filler))
        return

    if study.reuse_workers:  # the slot's long-lived DDP ranks instead of a TorchTrainer per trial
        from prvrlab.platform.search.workers import train_on_pool

        train_on_pool(loop_config, workers=study.workers, cpus=study.cpus_per_worker, gpus=study.gpus_per_worker, enrich=filler)
        return

    os.environ[WORKER_GROUP_START_TIMEOUT] = f"{study.placement_timeout_s:g}"  # Train propagates it to its controller
    with _admitted(study, trial_id) as attempt:
        admission = None if attempt is None else {"ledger": study.admission, "attempt": attempt}
        _fit_trainer(study, trial_id, {**loop_config, "admission": admission}, filler)


def _fit_trainer(study: StudyContext, trial_id: str, loop_config: dict[str, Any], filler: MetricFiller) -> None:
    """Fit a TorchTrainer (DDP over ``study.workers`` Train workers) for one trial attempt."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from prvrlab.platform.train.loopback import LoopbackTorchConfig
    from prvrlab.platform.train.session import process_group_backend

    use_gpu = study.gpus_per_worker > 0
    resources = {"CPU": study.cpus_per_worker, **({"GPU": study.gpus_per_worker} if use_gpu else {})}
    trainer = TorchTrainer(
        placed_worker,
        train_loop_config=loop_config,
        torch_config=LoopbackTorchConfig(backend=process_group_backend(use_gpu)),
        scaling_config=ScalingConfig(num_workers=study.workers, use_gpu=use_gpu, resources_per_worker=resources),
        run_config=RunConfig(
            name=trial_id,
            storage_path=study.where("train"),
            # retries are Tune's (max_retries), a worker group start timeout included (Train's default retries it forever)
            failure_config=FailureConfig(max_failures=0, controller_failure_limit=0),
            checkpoint_config=CheckpointConfig(num_to_keep=1),
            callbacks=[_report_callback(filler)],
        ),
    )
    trainer.fit()


def worker_group_needs(study: StudyContext) -> dict[str, float]:
    """What a multi-worker trial holds: its actor and its worker group."""
    needs = {"CPU": TRIAL_ACTOR_CPU + study.workers * study.cpus_per_worker}
    if study.gpus_per_worker > 0:
        needs["GPU"] = study.workers * study.gpus_per_worker
    return needs


def _admitted(study: StudyContext, trial_id: str):
    """Wait for the study's admission ledger to grant the worker group (no ledger: at once)."""
    from contextlib import nullcontext

    from prvrlab.platform.search.admission import admitted

    if study.admission is None:
        return nullcontext(None)
    return admitted(study.admission, trial_id, worker_group_needs(study), timeout_s=study.placement_timeout_s)


def record_node(run_dir: str | Path, role: str) -> None:
    """Append ``<role> <Ray node id>`` to the run's ``nodes.txt`` (where each attempt ran)."""
    import ray

    node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"
    path = Path(run_dir) / NODES_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fh.write(f"{role} {node}\n")


def placed_worker(loop_config: dict[str, Any]) -> None:
    """A Train worker: records its node (``rank<r>``); rank 0 tells the admission ledger its worker
    group's placement group (removed if this attempt dies with its node); then trains."""
    import ray.train

    from prvrlab.platform.train.loop import train_worker

    rank = ray.train.get_context().get_world_rank()
    record_node(loop_config["run_dir"], f"rank{rank}")
    if rank == 0 and loop_config.get("admission"):
        from prvrlab.platform.search.admission import attach_worker_group

        attach_worker_group(loop_config["admission"]["ledger"], loop_config["admission"]["attempt"])
    train_worker(loop_config)


# ---------------------------------------------------------------- the driver


def _stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def study_location(storage_path: str | Path, kind: str, name: str) -> storage.Location:
    """``<storage>/<kind>/<name>`` (a local folder or an object-store URI): one folder per submission."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", name)
    return storage.Location(str(storage_path)).child(kind, safe)


def study_root(storage_path: str | Path, kind: str, name: str) -> Path:
    """The local folder (or staging mirror) of :func:`study_location`."""
    return study_location(storage_path, kind, name).local


def latest_study(location: storage.Location) -> storage.Location | None:
    """The newest submission under ``location`` that has Tune state, or None (local or object store)."""
    if not location.remote:
        found = latest_study_dir(location.local)
        return location.child(found.name) if found is not None else None
    for stamp in reversed(location.subdirs()):
        if location.child(stamp).has("tune"):
            return location.child(stamp)
    return None


def latest_study_dir(root: Path) -> Path | None:
    """The newest submission folder under ``root`` that has Tune state, or None."""
    if not root.is_dir():
        return None
    dirs = sorted(d for d in root.iterdir() if d.is_dir() and (d / "tune").is_dir())
    return dirs[-1] if dirs else None


def spec_hash(spec: StudySpec, *, absolute_base: bool = False) -> str:
    """Hash of a spec's resolved content (base config with overrides, space or variants, budget...),
    the same wherever the project is: the base config counts by its path from the spec's folder (a
    submitted job's copy is unpacked under a new folder each time).  ``absolute_base``: the hash studies
    recorded before that (its absolute path), which a resume still accepts."""
    fields = dataclasses.asdict(spec)
    fields.pop("path")
    if not absolute_base:
        fields["base_config"] = os.path.relpath(spec.base_config, Path(spec.path).parent)
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _check_owner(path: Path) -> None:
    info = path.lstat()
    if stat.S_ISLNK(info.st_mode):
        raise StudyError(f"refusing to resume: {path} is a symbolic link")
    if info.st_uid != os.getuid():
        raise StudyError(f"refusing to resume: {path} is not owned by the current user")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise StudyError(f"refusing to resume: {path} is writable by group or others")


def verify_state(study_dir: Path, uri: str | None = None) -> str | None:
    """Refuse a study folder whose Tune state could have been planted: not ours, group/other
    writable, or not matching the checksums this user's driver recorded (checked before anything is
    unpickled).  ``uri``: the study's object-store URI, whose pulled copy is checked.

    The checksums come from this user's private record (:func:`state_record`), written by the driver when
    its run ended or, for a local study whose driver was killed outright, by its run sentinel
    (:func:`prvrlab.platform.tracking.closer.watch`; a resume started while that sentinel is still at
    work waits for it).  A study with no record (run elsewhere, recorded before the private record
    existed, or its driver and sentinel both killed) is refused, since whoever wrote its folder or bucket
    could have written the state and its ``state.sha256`` too, unless ``PRVRLAB_TRUST_STUDY_STATE=1``:
    then the returned warning says so (None otherwise).
    """
    tune_dir = study_dir / "tune"
    for path in [study_dir, *([tune_dir, *tune_dir.rglob("*")] if tune_dir.is_dir() else [])]:
        _check_owner(path)
    remote = bool(uri and storage.is_remote(uri))
    if not remote:
        from prvrlab.platform.tracking.closer import await_study_record

        driver = await_study_record(study_dir)
        if driver is not None:
            raise StudyError(f"refusing to resume: {study_dir} is being run by a live driver (pid {driver})")
    record = state_record(study_dir, uri)
    if not record.is_file():
        where = uri if remote else str(study_dir)
        if os.environ.get(TRUST_STATE_ENV) == "1":
            return f"warning: no record of {where}'s Tune state on this machine; trusting it ({TRUST_STATE_ENV}=1)"
        raise StudyError(
            f"refusing to resume: this machine has no record of {where}'s Tune state ({record}): it ran elsewhere, "
            f"or its driver was killed with its run sentinel, and whoever wrote the study could have written its "
            f"state and checksums; resume where the study ran, or set {TRUST_STATE_ENV}=1 to trust it"
        )
    for path in (record.parent, record):  # a record in a folder others could write (a shared cache) vouches for nothing
        _check_owner(path)
    recorded, current = read_sums(record), state_sums(study_dir)
    for rel in sorted(set(recorded) | set(current)):
        if recorded.get(rel) != current.get(rel):
            change = "added" if rel not in recorded else "missing" if rel not in current else "modified"
            raise StudyError(f"refusing to resume: {study_dir / rel} was {change} since the driver recorded {record}")
    return None


def _record_final_state(location: storage.Location, study: StudyContext) -> None:
    """The driver's record of the Tune state it leaves (object store: pulled back first); its sentinel no
    longer needs to record it."""
    location.child("tune").pull(exclude=("checkpoint_*",), fresh=True)  # object store: the state to record
    record_state(Path(study.study_dir), study.storage or None)
    forget_writers(Path(study.study_dir))  # those of its trials that are gone
    closer.unwatch_study(study.study_dir)


def trial_resources(spec: StudySpec, cluster_cpus: float, cluster_gpus: float, *, whole: bool = True) -> tuple[float, float]:
    """(CPUs, GPUs) per Train worker for ``spec`` on this cluster; StudyError naming the key when
    ``concurrency`` would leave each worker less than Ray's 0.01 CPU, and, when the cluster is ``whole``
    (no node will join it), when one trial cannot run there.  On a growing cluster only GPUs the
    cluster lacks are refused; a share is computed from the CPUs it has now (below one CPU per worker
    when it has fewer CPUs than workers), and a trial whose explicit resources do not fit fails at run
    time after ``resources.placement_timeout_s``, with its reason."""
    res = spec.resources
    reserved = TRIAL_ACTOR_CPU if res.workers_per_trial > 1 else 0.0
    problem = shortfall(
        res.workers_per_trial,
        res.cpus_per_worker,
        res.gpus_per_worker,
        {"CPU": cluster_cpus, "GPU": cluster_gpus},
        workers_key="resources.workers_per_trial",
        cpus_key="resources.cpus_per_worker",
        gpus_setting=f"resources.gpus_per_worker={res.gpus_per_worker:g}",
        reserved=reserved,
    )
    if problem and (whole or (res.gpus_per_worker > 0 and cluster_gpus <= 0)):
        raise StudyError(f"{spec.path}: {problem}")
    if res.cpus_per_worker is not None and res.pack == 1:  # as asked (1.5 is 1.5), as train.cpus_per_worker
        return max(res.cpus_per_worker, 0.01), res.gpus_per_worker
    if res.cpus_per_worker is not None:  # a packed trial's part of it: whole CPUs, or hundredths below one
        return _cpu_share(res.cpus_per_worker / res.pack), res.gpus_per_worker
    share = (cluster_cpus - reserved * spec.slots) / (spec.slots * res.workers_per_trial)
    if share < 0.01:
        raise StudyError(
            f"{spec.path}: concurrency: {spec.concurrency}" + (f" x resources.pack: {res.pack}" if res.pack > 1 else "") + " trials of "
            f"{res.workers_per_trial} worker(s) at a time leave each worker under 0.01 of the cluster's {cluster_cpus:g} CPUs"
        )
    return _cpu_share(share), res.gpus_per_worker


def alive_nodes() -> int:
    """Alive nodes of the running Ray cluster."""
    import ray

    return sum(1 for node in ray.nodes() if node.get("Alive"))


def pooled_ranks(spec: StudySpec, cluster_cpus: float, cluster_gpus: float, *, nodes: int) -> bool:
    """Whether the study's trials train on reused worker pools (:mod:`.workers`).

    ``resources.reuse_workers`` where the spec says true or false (true for one worker: a one-rank pool).
    By default (``auto``) with ``resources.pack`` > 1, and for multi-worker CPU ranks on a one-node cluster
    where a trial fits now (this machine, or a workstation's cluster a search is submitted to with ``ray
    job submit``): there a worker group started per trial only costs time (~20 s a trial here;
    docs/performance.md, "Search overhead"), and a pool's trial that cannot be placed stops the study after
    ``resources.placement_timeout_s`` (:mod:`.placement`).  Elsewhere a worker group per trial: on
    several nodes a retried trial's group must be placed again after a node loss, which its admission
    ledger handles (:mod:`.admission`), and GPU pools are opt-in.  One worker trains inside the trial
    actor unless the spec says true: a one-rank pool reached its first step ~1 s sooner here, but its
    searches were not measurably quicker in all (docs/performance.md, session 45)."""
    res = spec.resources
    if res.reuse_workers is not None:
        return res.reuse_workers
    if res.workers_per_trial < 2:
        return False
    if res.pack > 1:
        return True
    if res.gpus_per_worker > 0 or nodes != 1:
        return False
    try:
        trial_resources(spec, cluster_cpus, cluster_gpus)  # the whole cluster: one trial fits it now
    except StudyError:
        return False
    return True


def cluster_size() -> tuple[float, float]:
    """(CPUs, GPUs) of the running Ray cluster."""
    import ray

    cluster = ray.cluster_resources()
    return float(cluster.get("CPU", os.cpu_count() or 1)), float(cluster.get("GPU", 0))


def check_cluster(spec: StudySpec) -> None:
    """Refuse (StudyError naming the key) resources this machine cannot hold, before anything is recorded,
    when the study will start its own Ray here.

    A running cluster (joined, or ``$RAY_ADDRESS``) is not checked up front: nodes may join it (an
    autoscaler adds them on demand), and a trial that still does not fit fails with its reason once
    ``resources.placement_timeout_s`` has passed.
    """
    import ray

    if ray.is_initialized() or os.environ.get("RAY_ADDRESS", "").strip():
        return
    cluster = local_cluster()
    trial_resources(spec, cluster["CPU"], cluster["GPU"])


def _cpu_share(share: float) -> float:
    """Whole CPUs at or above one, else hundredths (Ray's resolution), never below 0.01."""
    cpus = float(int(share)) if share >= 1 else math.floor(share * 100) / 100
    return max(cpus, 0.01)


def prepare_environment() -> None:
    """Driver-side settings: quiet output, strict metric check off, frequent state saves."""
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    os.environ.setdefault("TUNE_DISABLE_STRICT_METRIC_CHECKING", "1")  # final/non-finite rounds may lack the metric
    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", "2")
    os.environ.setdefault("TUNE_MAX_PENDING_TRIALS_PG", "1")
    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")


def _trainable(study: StudyContext, resources: dict[str, float], spares: list[list[Any]]):
    from ray import tune

    return tune.with_resources(tune.with_parameters(run_trial, study=study, spares=spares), resources)


@contextmanager
def spare_ranks(spec: StudySpec, trials: int, *, cpus: float, pooled: bool | None = None) -> Iterator[list[list[Any]]]:
    """CPU studies on reused pools (``pooled``, as the study resolved it; by default the spec's
    ``resources.reuse_workers``) on a one-node cluster: one group of pool ranks per slot, started now, so
    that their processes start and import torch while Tune starts its trial actors (see :mod:`.workers`);
    killed when the block ends (``cpus``: each rank's CPUs).  Otherwise no spares."""
    res = spec.resources
    groups = min(spec.slots, trials)
    pooled = bool(res.reuse_workers) if pooled is None else pooled
    if (
        not pooled or res.gpus_per_worker > 0 or groups < 1
        or alive_nodes() != 1  # on several, a spare's node could hold no trial's CPUs
    ):
        yield []
        return
    from prvrlab.platform.search.workers import start_spares, stop_spares

    spares = start_spares(groups, res.workers_per_trial, cpus)
    try:
        yield spares
    finally:
        stop_spares(spares)


@dataclass
class StudyResult:
    """What a study produced."""

    study_dir: Path
    parent_run_id: str
    counts: dict[str, int]
    best: dict[str, Any] | None  # {"trial_id", "value", "config", "path"} for a search
    interrupted: bool = False


def prepare_study(spec: StudySpec, *, resume: bool, kind: str, echo: Callable[[str], None]) -> tuple[ExperimentConfig, Path, bool]:
    """Resolve paths, prepare the data and pick the study folder (before Ray starts)."""
    from prvrlab.platform.runtime import prepare_data, resolve_config_paths

    base = resolve_config_paths(spec.base)
    storage.check(base.tracking.storage_path)  # unknown bucket, unreachable endpoint: one line naming the key
    prepare_data(base, progress=False)
    location = study_location(base.tracking.storage_path, kind, spec.name)
    root = location.local
    if resume:
        study_dir = resumable_study(spec, location, kind, echo)
        echo(f"resuming {kind} '{spec.name}' from {study_dir}")
        return base, study_dir, True
    while True:
        study_dir = root / _stamp()
        if not (location.remote and location.has(study_dir.name)):
            try:
                study_dir.mkdir(parents=True)  # atomic on this host: a submission in the same second waits for the next
                break
            except FileExistsError:
                pass
        time.sleep(1)
    claim_study(study_dir, location.child(study_dir.name).uri if location.remote else None)
    return base, study_dir, False


def resumable_study(spec: StudySpec, location: storage.Location, kind: str, echo: Callable[[str], None],
                    scratch: Path | None = None) -> Path:
    """The local folder of the submission ``--resume`` continues (a fresh copy when it is on an object
    store: in ``scratch`` when given, else its staging folder), verified as safe to unpickle and run with
    this spec; StudyError when there is none or it differs."""
    found = latest_study(location)
    if found is None:
        raise StudyError(f"nothing to resume: no earlier {kind} '{spec.name}' under {location.uri}")
    # this user's lock of the study, before anything is pulled or read: one driver at a time (--check only looks)
    holder = claim_study(found.local, found.uri if found.remote else None, hold=scratch is None)
    if holder is not None:
        raise StudyError(
            f"refusing to resume: {found.uri} is being run by another driver on this machine"
            + (f" (pid {holder})" if holder else "") + "; wait for it to end, or stop it"
        )
    # object store: a fresh local copy (Tune's checkpoints stay remote: only read as weights)
    study_dir = scratch / found.name if found.remote and scratch is not None else found.local
    found.pull(exclude=("train", "checkpoint_*"), fresh=True, into=study_dir)
    warning = verify_state(study_dir, found.uri if found.remote else None)
    if warning:
        echo(warning)
    limit = RunMap(study_dir).meta.get(TIME_LIMIT_META)
    if limit is not None:  # Tune keeps the budget left across a resume: none; every trial would stop at once
        raise StudyError(
            f"refusing to resume: {study_dir} ended when its budget.time_limit_s ({limit:g} s) ran out; "
            "submit it again without --resume to start a fresh search"
        )
    recorded = RunMap(study_dir).meta.get("spec_hash")
    if recorded is not None and recorded not in (spec_hash(spec), spec_hash(spec, absolute_base=True)):
        raise StudyError(
            f"refusing to resume: {study_dir} was run with a different '{spec.name}' spec; "
            "submit it again without --resume to start a fresh study"
        )
    return study_dir


def check_resume(spec: StudySpec, kind: str, echo: Callable[[str], None]) -> str:
    """``--check --resume``: where the submission a resume would continue is (a folder or an object-store
    URI), refused as the resume would refuse it; nothing is started, recorded or changed (no data
    preparation, no Ray, no MLflow; an object-store study is read into a throwaway folder, not its staging
    copy, which a running driver may be using)."""
    from prvrlab.platform.runtime import resolve_config_paths

    base = resolve_config_paths(spec.base)
    storage.check(base.tracking.storage_path, create=False)
    location = study_location(base.tracking.storage_path, kind, spec.name)
    with tempfile.TemporaryDirectory(prefix="prvrlab-check-") as scratch:
        study_dir = resumable_study(spec, location, kind, echo, scratch=Path(scratch))
        return location.child(study_dir.name).uri if location.remote else str(study_dir)


def header_comment(path: str | Path) -> str:
    """The comment lines at the top of a YAML file, without their ``#`` ('' when it has none)."""
    return "\n".join(line[1:].removeprefix(" ") for line in leading_comments(path)).strip()


def _spec_params(spec: StudySpec) -> dict[str, Any]:
    """The parent run's params: the spec's settings, one ``space.<key>`` / ``variant.<name>`` each."""
    from prvrlab.platform.runtime import project_relative

    spec_raw = read_yaml(spec.path)
    params = {"spec.metric": spec.metric, "spec.mode": spec.mode, "spec.base_config": project_relative(spec.base_config)}
    params.update({f"spec.{k}": v for k, v in spec_raw.items() if k not in ("space", "variants", "name", "base_config")})
    if spec.overrides:  # the file's and --set's, as applied (the file's alone left a --set unrecorded)
        params["spec.overrides"] = spec.overrides
    for key, value in (spec_raw.get("space") or {}).items():
        params[f"space.{key}"] = value
    for key, value in (spec_raw.get("variants") or {}).items():
        params[f"variant.{key}"] = value
    return params


def open_parent(tracker, runs: RunMap, spec: StudySpec, kind: str, study_dir: Path, parent_run_id: str | None = None) -> str:
    """Create the study's parent run, or reopen the one ``study.json`` (or the caller) names."""
    from prvrlab.platform.runtime import project_relative
    from prvrlab.platform.tracking.store import VERSION_TAG, commit_tags, git_commit, source_tags
    from prvrlab.platform.tracking.tags import provenance_tags

    run_id = runs.parent or parent_run_id
    params = _spec_params(spec)
    if run_id is not None:
        # An ablation submitted again after its spec grew (variants, seeds) continues under the same
        # parent: the spec as submitted now replaces the logged one, which the report reads; new keys
        # are logged (MLflow keeps a param's first value, so a param this submission changed is also a
        # tag NOW_TAG + key holding its value now), and the parent's study folder is this submission's.
        # The code and command tags (git_commit, the UI's Version and Source) become this submission's;
        # FIRST_COMMIT_TAG keeps the first submission's commit once another one continues the study.
        before = tracker.reopen_run(run_id)
        logged = set(before.data.params)
        now = {k: v for k, v in params.items() if k in logged and before.data.params[k] != tracker.param_text(v)}
        code = {**provenance_tags(git_commit()), **source_tags()}
        code.update(commit_tags(code))
        first = before.data.tags.get("git_commit")
        if first and first != code["git_commit"] and FIRST_COMMIT_TAG not in before.data.tags:
            code[FIRST_COMMIT_TAG] = first
        reopened = {"prvrlab.study_dir": str(study_dir), **code, **{NOW_TAG + k: v for k, v in now.items() if len(NOW_TAG + k) <= 250}}
        stale = [k for k in before.data.tags if k.startswith(NOW_TAG) and k[len(NOW_TAG):] not in now]
        if VERSION_TAG not in code and VERSION_TAG in before.data.tags:  # this commit unknown: no stale Version
            stale.append(VERSION_TAG)
    else:
        tags = {
            "prvrlab.kind": kind,
            "prvrlab.study": spec.name,
            **provenance_tags(git_commit()),
            "prvrlab.spec": project_relative(spec.path),
            "prvrlab.study_dir": str(study_dir),
        }
        description = header_comment(spec.path)
        if description:  # the run page's Description: what the spec's author wrote above it
            tags["mlflow.note.content"] = description
        run_id = tracker.start_run(f"{spec.name}-{study_dir.name}", tags=tags)
        logged, reopened, stale = set(), {}, []
    try:  # the run is RUNNING now: whatever fails before the caller holds it ends it here
        if reopened:
            tracker.set_tags(run_id, reopened)
        for key in stale:  # back to its logged value: no longer changed
            tracker.client.delete_tag(run_id, key)
        tracker.log_params(run_id, {k: v for k, v in params.items() if k not in logged})
        tracker.log_artifacts(run_id, [spec.path], "spec")
        runs.parent = run_id
        runs.meta.update({"kind": kind, "name": spec.name, "spec": project_relative(spec.path), "spec_hash": spec_hash(spec)})
        runs.save()
    except BaseException as exc:
        error = explain_exception(exc, hint=STUDY_HINT, origin="the driver").summary
        tracker.end_stopped(run_id, exc, failed_tags={"error": error})
        raise
    return run_id


def trials_total(study_dir: str | Path, total: int, resume: bool) -> int:
    """How many trials the progress lines count: ``total`` for a new submission, recorded in ``study.json``;
    for a resume the first submission's count (Tune restores that submission's trial list, finished trials
    included, while a resumed ablation's caller counts only the cells left to run)."""
    runs = RunMap(study_dir)
    if resume and runs.meta.get("trials_total"):
        return int(runs.meta["trials_total"])
    runs.meta["trials_total"] = total
    runs.save()
    return total


def run_study(
    spec: StudySpec,
    study: StudyContext,
    *,
    tune_config_kwargs: dict[str, Any],
    param_space: dict[str, Any],
    resume: bool,
    tracker,
    total: int,
    progress: bool = True,
    echo: Callable[[str], None] | None = print,
    stop: Any = None,
) -> tuple[Any, MlflowStudyCallback, bool]:
    """Run (or restore) the Tune experiment of ``study``; returns (ResultGrid, callback, interrupted).
    ``stop``: Tune's stopper (a search's :class:`~.time_limit.TimeLimit`; a restore keeps the saved one).
    ``echo``: where admission notes (why a trial waits) go besides ``study.log``."""
    from ray import tune

    from prvrlab.platform.search.progress import ProgressCallback

    if study.workers == 1:
        resources = {"cpu": study.cpus_per_worker, "gpu": study.gpus_per_worker}
    else:
        resources = {"cpu": TRIAL_ACTOR_CPU}
    if study.reuse_workers:  # the trial actor's bundle (empty for one rank: it keeps the whole share) + one per rank
        from prvrlab.platform.search.workers import pool_resources

        actor_cpu = TRIAL_ACTOR_CPU if study.workers > 1 else 0.0
        resources = pool_resources(study.workers, study.cpus_per_worker, study.gpus_per_worker, actor_cpu)
    reuse_actors = study.workers == 1 or study.reuse_workers  # a reused trial actor keeps its slot's pool
    with spare_ranks(spec, total, pooled=study.reuse_workers, cpus=study.cpus_per_worker) as spares:  # killed once Tune's trials have ended
        trainable = _trainable(study, resources, spares)
        tune_path = study.where("tune")
        total = trials_total(study.study_dir, total, resume)
        mlflow_cb = MlflowStudyCallback(study)
        callbacks: list[Any] = [mlflow_cb]
        if progress:
            callbacks.append(
                ProgressCallback(
                    spec.metric, spec.mode, total, study.label, progress_of=study.trial_progress, ended=study.trial_ended
                )
            )
        stop_admission = _start_admission(study, callbacks, echo=echo if progress else None)
        from prvrlab.platform.search.placement import PlacementWatch, Unplaced

        callbacks.append(PlacementWatch(timeout_s=study.placement_timeout_s))  # Tune would wait for ever
        if resume and tune.Tuner.can_restore(tune_path):
            tuner = tune.Tuner.restore(tune_path, trainable=trainable, resume_unfinished=True, resume_errored=False)
            tuner._local_tuner.get_run_config().callbacks = callbacks  # fresh driver-side callbacks
        else:
            tuner = tune.Tuner(
                trainable,
                param_space=param_space,
                tune_config=tune.TuneConfig(
                    metric=spec.metric, mode=spec.mode, reuse_actors=reuse_actors, **tune_config_kwargs
                ),
                run_config=tune.RunConfig(
                    name="tune",
                    storage_path=study.storage or str(study.study_dir),
                    verbose=0,
                    callbacks=callbacks,
                    stop=stop,
                    failure_config=tune.FailureConfig(max_failures=spec.max_retries),
                    checkpoint_config=tune.CheckpointConfig(num_to_keep=1),
                    log_to_file=True,
                ),
            )
        interrupted = False
        unplaced: Unplaced | None = None
        INTERRUPTED.clear()
        TIME_LIMIT.clear()
        location = storage.Location(study.storage or study.study_dir)
        location.remove(STATE_SUMS)  # stale once Tune writes again; re-recorded at the end
        forget_state(Path(study.study_dir), study.storage or None)
        if not study.storage:  # a local study: a driver killed outright has its sentinel record the state
            closer.watch_study(study.study_dir)
        previous = _sigterm_as_sigint()
        try:
            with ray_logs_to(Path(study.study_dir) / STUDY_LOG), mlflow_cb.mirror.every(SYNC_S):  # warnings off the console
                results = tuner.fit()
        except KeyboardInterrupt:
            interrupted = True
            results = None
        except Unplaced as exc:
            unplaced, results = exc, None
        except BaseException:  # Tune failed: its state is still what a --resume restores
            try:
                _record_final_state(location, study)
            except Exception as exc:  # noqa: BLE001 - the failure above is the one to report
                print(f"prvrlab: warning: could not record the study's Tune state: {exc}", file=sys.stderr)
            raise
        finally:
            stop_admission()
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
    _record_final_state(location, study)
    mlflow_cb.mirror.push()
    trials = _trials(tuner)
    if INTERRUPTED.is_set() or any(t.status in ("PENDING", "RUNNING", "PAUSED") for t in trials):
        interrupted = True
    mlflow_cb.close_all(trials, interrupted=interrupted or unplaced is not None)
    if unplaced is not None:  # the parent run ends FAILED with the reason; the command exits non-zero
        if mlflow_cb.runs.parent:
            tracker.set_tags(mlflow_cb.runs.parent, {"prvrlab.status": "failed", "prvrlab.stop_reason": str(unplaced)})
        raise unplaced
    return results, mlflow_cb, interrupted


def admission_name(study_dir: str | Path) -> str:
    """The admission ledger actor's name for a study folder (unique per study)."""
    return "prvrlab-admission-" + hashlib.sha256(str(study_dir).encode()).hexdigest()[:16]


def _start_admission(study: StudyContext, callbacks: list[Any], echo: Callable[[str], None] | None) -> Callable[[], None]:
    """Multi-worker studies: start the admission ledger and add a callback reporting why trials
    wait (console and ``study.log``); returns what stops the ledger."""
    if study.admission is None:
        return lambda: None
    from ray.tune import Callback

    from prvrlab.platform.search.admission import AdmissionReporter, LedgerPoller, start_ledger, stop_ledger

    ledger = start_ledger(study.admission)
    log = Path(study.study_dir) / STUDY_LOG

    def say(line: str) -> None:
        if echo is not None:
            echo(line)
        with log.open("a", encoding="utf-8") as fh:
            fh.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} INFO prvrlab.admission: {line}\n")

    poller = LedgerPoller(ledger, AdmissionReporter(worker_group_needs(study), say))

    class ReportAdmission(Callback):
        def on_step_end(self, iteration, trials, **info) -> None:
            poller.poll()

    callbacks.append(ReportAdmission())
    return lambda: stop_ledger(study.admission)


def _sigterm_as_sigint():
    """Make SIGTERM stop Tune like Ctrl-C (state saved, trials stopped); returns the old handler.

    The study's open MLflow runs are closed KILLED at once by a detached process
    (:func:`~prvrlab.platform.tracking.closer.stop_requested`): ``ray job stop``
    follows its SIGTERM with a SIGKILL after ``RAY_JOB_STOP_WAIT_TIME_S`` (3 s by
    default), often before Tune has wound down.  The graceful path then closes
    them again with their final state.
    """
    if threading.current_thread() is not threading.main_thread():
        return None

    def forward(signum, frame) -> None:
        from prvrlab.platform.tracking.closer import stop_requested

        INTERRUPTED.set()
        stop_requested("stopped by SIGTERM")
        os.kill(os.getpid(), signal.SIGINT)

    return signal.signal(signal.SIGTERM, forward)


def _trials(tuner) -> list[Any]:
    """The trials Tune knows (for closing runs after an interrupt)."""
    try:
        grid = tuner.get_results()
    except Exception:
        return []
    analysis = getattr(grid, "_experiment_analysis", None)
    return list(getattr(analysis, "trials", []) or [])


def count_outcomes(trials, killed: set[str] = frozenset()) -> dict[str, int]:
    """finished / early_stopped / failed / unfinished counts over Tune trials (``killed``: trials
    whose run the driver closed KILLED, i.e. ended by an interrupt, count as unfinished)."""
    counts = {"finished": 0, "early_stopped": 0, "failed": 0, "unfinished": 0}
    for t in trials:
        if t.trial_id in killed or (t.status == "TERMINATED" and not t.last_result):  # or ended before it reported
            counts["unfinished"] += 1
        elif t.status == "TERMINATED":
            outcome = trial_outcome(t.last_result)
            counts["failed" if outcome in FAILED_OUTCOMES else outcome] += 1
        elif t.status == "ERROR":
            counts["failed"] += 1
        else:
            counts["unfinished"] += 1
    return counts


def tag_study_error(tracker, parent: str, exc: BaseException) -> None:
    """Tag a study's parent run that an error ended with ``prvrlab.status: failed`` and the error's one line
    (best effort: the run is closed whatever this raises).  A refusal already tagged keeps its reason."""
    try:
        tags = {"prvrlab.status": "failed", "error": explain_exception(exc, hint=STUDY_HINT, origin="the driver").summary}
        tracker.set_tags(parent, tags)
    except Exception as tag_exc:  # noqa: BLE001 - the parent run must still end
        print(f"prvrlab: warning: tagging the study's error failed: {type(tag_exc).__name__}: {tag_exc}", file=sys.stderr)


def parent_status(tracker, parent: str, *, interrupted: bool, ok: bool, complete: bool) -> str:
    """The MLflow status a study's parent run closes with, tagging ``prvrlab.status`` when the study ran
    to its end: FAILED / ``failed`` when nothing usable came out (not ``ok``), else FINISHED with
    ``partial`` when trials or cells failed or are missing (not ``complete``), ``finished`` otherwise."""
    if interrupted:
        return "KILLED"
    outcome = "failed" if not ok else "finished" if complete else "partial"
    tracker.set_tags(parent, {"prvrlab.status": outcome})
    return "FAILED" if not ok else "FINISHED"


def make_study(
    spec: StudySpec,
    kind: str,
    base: ExperimentConfig,
    study_dir: Path,
    cells=None,
    resolved: dict[str, ExperimentConfig] | None = None,
) -> StudyContext:
    """A :class:`StudyContext` for ``spec`` with per-worker resources from the running cluster
    (``resolved``: configs the driver already validated, keyed as ``StudyContext.resolved``)."""
    from prvrlab.platform.search.names import short_keys
    from prvrlab.platform.train.loop import fault_hook_from_env

    cluster = cluster_size()
    cpus, gpus = trial_resources(spec, *cluster, whole=False)  # a local cluster was checked up front
    runs = RunMap(study_dir)
    pooled = runs.meta.get("pooled_ranks") if spec.resources.reuse_workers is None else None
    if pooled is None:  # a resumed study keeps the way its ranks were first chosen
        pooled = pooled_ranks(spec, *cluster, nodes=alive_nodes())
        runs.meta["pooled_ranks"] = pooled
        runs.save()
    base_raw = apply_overrides(base.to_dict(), {})
    study = StudyContext(
        kind=kind,
        name=spec.name,
        study_dir=str(study_dir),
        base_raw=base_raw,
        metric=spec.metric,
        mode=spec.mode,
        workers=spec.resources.workers_per_trial,
        cpus_per_worker=cpus,
        gpus_per_worker=gpus,
        tracking_uri=base.tracking.uri,
        experiment=base.tracking.experiment,
        cells=cells,
        fault=fault_hook_from_env(),
        short_keys=short_keys(p.key for p in getattr(spec, "space", ())),
        trial_digits=len(str(getattr(spec, "trials", 1))),
        reuse_workers=pooled,
        admission=admission_name(study_dir) if spec.resources.workers_per_trial > 1 and not pooled else None,
        placement_timeout_s=spec.resources.placement_timeout_s,
        time_limit_s=getattr(spec, "time_limit_s", None),
    )
    location = study_location(base.tracking.storage_path, kind, spec.name).child(Path(study_dir).name)
    study.storage = location.uri if location.remote else ""
    study.driver = driver_tags()
    study.resolved.update(resolved or {})
    for cell in cells or {}:  # an ablation's configs are all known: resolve them once, here
        study.experiment_config({"cell": cell})
    return study


def killed_trials(study_dir: Path) -> set[str]:
    """Trials whose child run was closed KILLED (ended by an interrupt or the search's time limit)."""
    return {t for t, status in RunMap(study_dir).closed.items() if status == "KILLED"}


def runs_for(study_dir: Path) -> dict[str, str]:
    """trial id -> child run id of a study folder."""
    return RunMap(study_dir).trials
