"""The training driver: validated config -> Ray Train DDP run -> MLflow run.

The driver checks the data before Ray starts, starts (or joins) Ray, fits a
``TorchTrainer`` whose workers run :func:`prvrlab.platform.worker.train_worker`,
and is the only process writing to MLflow: worker reports travel from the Train
controller to the driver through a Ray queue, and the driver logs them, prints
one line per epoch, and closes the run FINISHED, FAILED or KILLED.
"""

from __future__ import annotations

import itertools
import json
import os
import queue as stdlib_queue
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from prvrlab.files import write_text_atomically
from prvrlab.models.component import DISTRIBUTIONS_DIR
from prvrlab.platform import storage
from prvrlab.platform.config import ConfigError, ExperimentConfig
from prvrlab.platform.failures import (  # TrainingError lives there: the CLI catches it without importing torch
    ERROR_FILE,
    Failure,
    TrainingError,
    carries_interrupt,
    explain_exception,
    failure_text,
    interrupts_unwrapped,
    record_failure,
    with_disk_note,
)
from prvrlab.platform.resources import shortfall
from prvrlab.platform.runtime import ensure_ray, prepare_data, resolve_config_paths
from prvrlab.platform.train.live import LiveLine
from prvrlab.platform.train.session import process_group_backend
from prvrlab.platform.tracking.drivers import close_dead_runs
from prvrlab.platform.tracking.store import Tracker, best_point, store_errors
from prvrlab.platform.tracking.uri import resolve_tracking_uri
from prvrlab.platform.tracking.tags import run_tags
from prvrlab.uris import redact_credentials


@dataclass
class TrainResult:
    """What a finished run produced."""

    run_id: str
    run_dir: Path
    best_sumr: float
    best_epoch: int
    final_metrics: dict[str, Any]
    history: list[dict[str, Any]] = field(default_factory=list)


def run_name_for(cfg: ExperimentConfig) -> str:
    """A filesystem-safe run name: <name>-<timestamp> (made unique by :func:`claim_run_name`)."""
    stem = cfg.tracking.run_name or cfg.name
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "-", stem).strip("-") or "run"
    return f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"


def claim_run_name(cfg: ExperimentConfig) -> str:
    """:func:`run_name_for`, with ``-2``, ``-3``, ... added while that name's folder under
    ``tracking.storage_path`` exists; the folder is made here (atomically on this host: two runs started in
    the same second get two names, not one folder whose files, checkpoints and metrics they would mix)."""
    base, root = run_name_for(cfg), storage.Location(cfg.tracking.storage_path)
    for name in (base if n == 1 else f"{base}-{n}" for n in itertools.count(1)):
        if root.remote and root.has(name):
            continue
        try:
            root.child(name).local.mkdir(parents=True)
            return name
        except FileExistsError:
            continue


def cpus_per_worker(cfg: ExperimentConfig, cluster_cpus: float, reserved: float = 0.0) -> float:
    """CPUs per Train worker: the configured value or an equal share of the cluster."""
    if cfg.train.cpus_per_worker is not None:
        return cfg.train.cpus_per_worker
    share = (cluster_cpus - reserved) / cfg.train.num_workers
    if share <= 0:
        raise TrainingError(
            f"the cluster has {cluster_cpus:g} CPUs, too few for {cfg.train.num_workers} workers"
        )
    return float(int(share)) if share >= 1 else round(share, 3)


def check_resources(cfg: ExperimentConfig, cluster: dict[str, float]) -> None:
    """Raise ConfigError naming the key when ``cfg`` asks for more than ``cluster`` has."""
    problem = shortfall(
        cfg.train.num_workers,
        cfg.train.cpus_per_worker,
        1.0 if cfg.train.use_gpu else 0.0,
        cluster,
        workers_key="train.num_workers",
        cpus_key="train.cpus_per_worker",
        gpus_setting="train.use_gpu=true",
    )
    if problem:
        raise ConfigError(problem)


def check_in_process(cfg: ExperimentConfig) -> None:
    """``--no-ray``: ConfigError when ``train.use_gpu`` asks for a CUDA device this process does not see."""
    import torch

    from prvrlab.platform.train.loop import NO_CUDA

    if cfg.train.use_gpu and not torch.cuda.is_available():
        raise ConfigError(NO_CUDA.format(who="this machine") + " (prvrlab train --no-ray trains in this process)")


def format_epoch_line(m: dict[str, Any], epochs: int) -> str:
    """One concise line per epoch (``epoch`` and ``best/epoch`` count from 1, as reported)."""
    terms = " ".join(
        f"{k[len('train/'):]}={m[k]:.4f}" for k in sorted(m) if k.startswith("train/") and k != "train/loss"
    )
    return (
        f"epoch {m['epoch']:>3}/{epochs}  loss {m.get('train/loss', float('nan')):.4f} ({terms})  "
        f"val SumR {m.get('val/sumr', float('nan')):6.1f} [R@1 {m.get('val/r1', 0):.1f} R@5 {m.get('val/r5', 0):.1f} "
        f"R@10 {m.get('val/r10', 0):.1f} R@100 {m.get('val/r100', 0):.1f}]  "
        f"best {m['best/sumr']:.1f}@{m['best/epoch']}  {m['time/epoch_s']:.1f}s"
    )


class RunRecorder:
    """Turns worker reports into MLflow metrics and console lines (driver side)."""

    def __init__(self, tracker: Tracker, run_id: str, epochs: int, echo: Callable[[str], None] | None) -> None:
        self.tracker, self.run_id, self.epochs, self.echo = tracker, run_id, epochs, echo
        self.history: list[dict[str, Any]] = []
        self.final: dict[str, Any] = {}
        self.error: str | None = None

    def __call__(self, metrics: dict[str, Any]) -> None:
        kind = metrics.get("kind")
        if kind == "epoch":
            self.history.append(metrics)
            self.tracker.log_metrics(self.run_id, metrics, step=int(metrics["epoch"]))
            if self.echo:
                self.echo(format_epoch_line(metrics, self.epochs))
        elif kind == "final":
            self.final = metrics
            self.tracker.log_metrics(self.run_id, {f"final/{k}": v for k, v in metrics.items()})
        elif kind == "nonfinite":
            self.error = str(metrics.get("error", "non-finite loss"))


def _queue_callback(q):
    """A Train UserCallback forwarding rank 0's reports to the driver's queue."""
    from ray.train import UserCallback

    class ForwardReports(UserCallback):
        def after_report(self, run_context, metrics, checkpoint):
            if metrics:
                q.put(dict(metrics[0]))

    return ForwardReports()


def fit_with_ray(
    cfg: ExperimentConfig,
    run_dir: Path,
    run_name: str,
    on_report: Callable[[dict], None],
    on_retry: Callable[[Failure, int], None] | None = None,
    on_progress: Callable[[dict[str, Any] | None], None] | None = None,
    sync_to: str | None = None,
) -> None:
    """Fit a TorchTrainer for ``cfg``; every rank-0 report goes to ``on_report``, the polled
    in-epoch progress file (``progress.json``) to ``on_progress``; rank 0 pushes its run files
    to ``sync_to`` (an object-store URI, :mod:`prvrlab.platform.storage`) when given.

    Retries are the driver's, not Ray's: a failure :func:`explain_exception` calls
    retryable (an OOM kill, a dead worker, a lost node; these can also kill Ray
    Train's controller, which Ray's own ``FailureConfig`` cannot recover) fits the
    same run again, which resumes from its recovery checkpoint, up to
    ``train.max_failures`` times; an error in the training code is not retried.
    Every failure's full text is appended to ``<run_dir>/error.txt``; the raised
    TrainingError carries the one-line summary.
    """
    failures = 0
    while True:
        try:
            with interrupts_unwrapped():  # a stop is neither retried nor recorded as a failure
                _fit_once(cfg, run_dir, run_name, on_report, on_progress, sync_to)
            return
        except (ConfigError, TrainingError):
            raise
        except Exception as exc:
            failure = with_disk_note(explain_exception(exc), run_dir)
            record_failure(run_dir / ERROR_FILE, failure_text(exc), failure, attempt=failures + 1)
            if not failure.retryable or failures >= cfg.train.max_failures:
                raise TrainingError(failure.summary) from exc
            failures += 1
            if on_retry is not None:
                on_retry(failure, failures)


def _fit_once(
    cfg: ExperimentConfig,
    run_dir: Path,
    run_name: str,
    on_report: Callable[[dict], None],
    on_progress: Callable[[dict[str, Any] | None], None] | None = None,
    sync_to: str | None = None,
) -> None:
    """One ``TorchTrainer.fit()`` (Ray retries nothing); Ray's exception is re-raised as is."""
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.util.queue import Queue

    from prvrlab.platform.train.live import PROGRESS_FILE, read_progress
    from prvrlab.platform.train.loopback import LoopbackTorchConfig
    from prvrlab.platform.train.loop import fault_hook_from_env, train_worker

    ensure_ray()
    check_resources(cfg, ray.cluster_resources())
    cpus = cpus_per_worker(cfg, float(ray.cluster_resources().get("CPU", os.cpu_count() or 1)))
    reports = Queue(actor_options={"num_cpus": 0})
    trainer = TorchTrainer(
        train_worker,
        train_loop_config={
            "experiment": cfg,
            "run_dir": str(run_dir),
            "cpus_per_worker": cpus,
            "fault": fault_hook_from_env(),
            "sync_to": sync_to,
        },
        torch_config=LoopbackTorchConfig(backend=process_group_backend(cfg.train.use_gpu)),
        scaling_config=ScalingConfig(
            num_workers=cfg.train.num_workers,
            use_gpu=cfg.train.use_gpu,
            resources_per_worker={"CPU": cpus, **({"GPU": 1} if cfg.train.use_gpu else {})},
        ),
        run_config=RunConfig(
            name=run_name,
            storage_path=cfg.tracking.storage_path,
            failure_config=FailureConfig(max_failures=0),  # retried by fit_with_ray
            checkpoint_config=CheckpointConfig(num_to_keep=1),
            callbacks=[_queue_callback(reports)],
        ),
    )
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as exc:  # re-raised in the driver thread
            outcome["error"] = exc

    thread = threading.Thread(target=target, name="prvrlab-fit", daemon=True)
    thread.start()
    try:
        poll = (lambda: on_progress(read_progress(run_dir / PROGRESS_FILE))) if on_progress is not None else None
        queue_error = _forward_reports(thread, reports, on_report, poll)
    finally:
        thread.join(timeout=5)
        try:
            ray.kill(reports.actor)
        except Exception:
            pass
    if "error" in outcome:
        raise outcome["error"]
    if queue_error is not None:
        raise queue_error


def _forward_reports(
    thread: threading.Thread, reports, on_report: Callable[[dict], None], idle: Callable[[], None] | None = None
) -> BaseException | None:
    """Hand every report to ``on_report`` until the fit in ``thread`` has ended and the queue is drained
    (``idle`` is called whenever no report came for 0.5 s).

    If the queue's actor dies (Ray's memory monitor may pick it), the fit is
    waited for — a retry must not start beside a still-running controller — and
    the actor's error is returned.
    """
    import ray

    try:
        while True:
            alive = thread.is_alive()
            try:
                on_report(reports.get(timeout=0.5))
            except (stdlib_queue.Empty, ray.util.queue.Empty):
                if not alive:
                    return None
                if idle is not None:
                    idle()
    except ray.exceptions.RayError as exc:
        while thread.is_alive():
            thread.join(timeout=1)
        return exc


# prvrlab.status of a training run as it ends (as a trial's: finished | error | killed), so one tag filters them all
ENDED_TAGS = {
    "FINISHED": {"prvrlab.status": "finished"},
    "FAILED": {"prvrlab.status": "error"},
    "KILLED": {"prvrlab.status": "killed", "prvrlab.stop_reason": "interrupted"},
}


def _console(write: Callable[[Any], None]) -> Callable[[Any], None]:
    """``write`` (a console line or progress update) gone quiet once its reader went away (``| head``):
    a closed pipe never fails a run or stops it from being closed."""
    gone = False

    def say(item: Any) -> None:
        nonlocal gone
        if gone:
            return
        try:
            write(item)
        except BrokenPipeError:
            gone = True

    return say


def _best_effort(what: str, step: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """One step of recording a run's end (a tag, an artifact, a line); an error only warns on stderr,
    so the run is still closed. An interrupt (wrapped or not: :func:`carries_interrupt`) goes on."""
    try:
        step(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the run must still end
        if carries_interrupt(exc):
            raise KeyboardInterrupt from exc
        print(f"prvrlab: warning: {what} failed: {type(exc).__name__}: {redact_credentials(str(exc))}", file=sys.stderr)


def _clearing(live: LiveLine, echo: Callable[[str], None]) -> Callable[[str], None]:
    """``echo`` that first erases the live progress line."""

    def say(text: str) -> None:
        live.clear()
        echo(text)

    return say


def check_storage(storage_path: str) -> None:
    """Create the results folder (or reach the bucket) and check a file can be written there; ConfigError otherwise."""
    storage.check(storage_path)


def _push_run_files(run_dir: Path, sync_to: str | None, echo: Callable[[str], None] | None) -> None:
    """The driver's files of a run (config, history, error text) to the object store, if any."""
    try:
        storage.Mirror(run_dir, sync_to, exclude=storage.WORKER_FILES).push()
    except OSError as exc:
        if echo:
            echo(f"could not upload {run_dir} to {sync_to}: {exc}")


def amp_note(cfg: ExperimentConfig, native: bool | None = None) -> str | None:
    """A warning when ``train.amp: bf16`` runs on a CPU without native bf16 units (emulated: slower than fp32).

    ``native``: whether this machine's CPU has them (default: probed here, on the driver).
    """
    if cfg.train.amp != "bf16" or cfg.train.use_gpu:
        return None
    if native is None:
        from prvrlab.models.precision import native_low_precision

        native = native_low_precision("cpu")
    if native:
        return None
    return (
        "note: train.amp=bf16 on a CPU without AMX or AVX512-BF16: bf16 is emulated and "
        "usually slower than fp32 here; set train.amp=none unless the workers run elsewhere"
    )


def _has_text(path: Path) -> bool:
    """Whether ``path`` is a file with something in it."""
    try:
        return path.is_file() and path.stat().st_size > 0
    except OSError:
        return False


def train(
    cfg: ExperimentConfig,
    *,
    use_ray: bool = True,
    echo: Callable[[str], None] | None = print,
    parent_run_id: str | None = None,
) -> TrainResult:
    """Train ``cfg`` and record it as one MLflow run; raises TrainingError on failure."""
    from prvrlab.data.collection import configured_splits
    from prvrlab.platform.tracking.datasets import collection_dataset

    if echo is not None:
        echo = _console(echo)
    cfg = resolve_config_paths(cfg)
    collection = prepare_data(cfg, progress=echo is not None)
    note = amp_note(cfg)
    if note and echo:
        echo(note)
    if use_ray:
        import ray

        ensure_ray(echo=echo)
        check_resources(cfg, ray.cluster_resources())
    else:
        check_in_process(cfg)
    tracker = Tracker(cfg.tracking.uri or resolve_tracking_uri(None), cfg.tracking.experiment)
    check_storage(cfg.tracking.storage_path)
    name = claim_run_name(cfg)
    run_files = storage.Location(cfg.tracking.storage_path).child(name, "files")
    run_dir = run_files.local  # the folder itself, or the object store's staging mirror
    sync_to = run_files.uri if run_files.remote else None
    live = LiveLine() if echo is not None else None  # before the run starts: nothing between it and `try` can fail
    if live is not None:
        echo = _console(_clearing(live, echo))
    with store_errors(tracker.uri):
        for orphan in close_dead_runs(tracker):
            if echo:
                echo(f"closed run {orphan} as KILLED: its driver died without closing it")
        run_id = tracker.start_run(name, tags=run_tags(cfg), parent_run_id=parent_run_id)  # with its driver's tags
    recorder = RunRecorder(tracker, run_id, cfg.train.epochs, echo)

    def on_retry(failure: Failure, retry: int) -> None:
        tracker.set_tags(run_id, {"prvrlab.retries": str(retry), "prvrlab.last_failure": failure.summary})
        if echo:
            echo(f"{redact_credentials(failure.summary)}\n  retrying from the last checkpoint ({retry} of train.max_failures={cfg.train.max_failures})")

    status = "FAILED"
    try:
        if echo:
            echo(f"run {name}  (MLflow run {run_id}, store {redact_credentials(tracker.uri)})")
        with interrupts_unwrapped():  # an interrupt wrapped by other code still ends the run KILLED
            tracker.log_params(run_id, cfg.flat())
            tracker.log_dataset(run_id, collection_dataset(collection, configured_splits(cfg.data)))
            run_dir.mkdir(parents=True, exist_ok=True)
            write_text_atomically(run_dir / "config.yaml", cfg.to_yaml())
            on_progress = _console(live.update) if live is not None else None
            if use_ray:
                fit_with_ray(cfg, run_dir, name, recorder, on_retry, on_progress, sync_to)
            else:
                from prvrlab.platform.train.loop import run_local

                run_local(cfg, run_dir, on_report=recorder, on_progress=on_progress, sync_to=sync_to)
            run_files.pull(exclude=("config.yaml",))  # rank 0's files, when it ran on another node
            if recorder.error:
                raise TrainingError(recorder.error)
            if not recorder.final:
                raise TrainingError("training ended without its final report")
            tracker.log_metrics(run_id, *best_point(recorder.final))
            tracker.log_artifacts(run_id, [run_dir / "config.yaml"])
            tracker.log_artifacts(run_id, sorted(run_dir.glob("ranks_*.parquet")), "ranks")
            tracker.log_artifacts(run_id, sorted((run_dir / DISTRIBUTIONS_DIR).glob("*.json")), DISTRIBUTIONS_DIR)
            tracker.log_artifacts(run_id, [run_dir / "best_model.pt"], "checkpoints")
            write_text_atomically(run_dir / "history.json", json.dumps(recorder.history, indent=1))
            status = "FINISHED"
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    except TrainingError as exc:
        _best_effort("tagging the run's error", tracker.set_tags, run_id, {"error": str(exc)})
        raise
    except Exception as exc:
        failure = with_disk_note(explain_exception(exc, origin="the driver"), run_dir)
        _best_effort(f"writing {ERROR_FILE}", record_failure, run_dir / ERROR_FILE, failure_text(exc), failure, attempt=1)
        _best_effort("tagging the run's error", tracker.set_tags, run_id, {"error": failure.summary})
        raise TrainingError(failure.summary) from exc
    finally:
        try:  # each step best effort, and the run ends whatever they raise
            if live is not None:
                _best_effort("clearing the progress line", live.clear)
            if _has_text(run_dir / ERROR_FILE):  # every failure's full text, retried ones included (a full disk: none)
                _best_effort(f"logging {ERROR_FILE} to MLflow", tracker.log_artifacts, run_id, [run_dir / ERROR_FILE])
                if status != "FINISHED" and echo:
                    _best_effort("printing where the error text is", echo, f"full error text: {run_dir / ERROR_FILE} (artifact {ERROR_FILE} of MLflow run {run_id})")
            _best_effort("uploading the run's files", _push_run_files, run_dir, sync_to, echo)
        except KeyboardInterrupt:
            status = "KILLED"
            raise
        finally:
            try:
                _best_effort("tagging how the run ended", tracker.set_tags, run_id, ENDED_TAGS[status])
            finally:
                tracker.end_run(run_id, status)
    return TrainResult(
        run_id=run_id,
        run_dir=run_dir,
        best_sumr=float(recorder.final["best/sumr"]),
        best_epoch=int(recorder.final["best/epoch"]),
        final_metrics=recorder.final,
        history=recorder.history,
    )

