"""Plain explanations of failed runs and trials, from the texts Ray raises.

Ray's errors are long (an OOM kill lists the object store, every process
considered and the top memory users; a dead worker repeats the actor's
metadata) and the part that says what happened comes first.  This module
turns such a text into one line a user can act on, and says whether
retrying can help:

- out of memory (Ray's memory monitor killed processes): retryable — the
  pressure may come from something else on the node, and the run resumes
  from its recovery checkpoint;
- a worker process that died (signal, kernel OOM killer, crash): retryable;
- a lost node or a preemption: retryable;
- a worker group that could not be placed in time (the cluster shrank):
  retryable — Tune tries the trial again later;
- an exception raised by the training code (a bug, bad data, a GPU out of
  memory): not retryable — the same step fails the same way again.

A non-finite loss and a config error never get here: the training loop
reports the first, config validation rejects the second before Ray starts.
Everything here is pure (text in, :class:`Failure` out).
"""

from __future__ import annotations

import re
import shutil
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

ERROR_FILE = "error.txt"  # the full text of every failure of a run, an artifact of its MLflow run
TRAIN_HINT = "lower train.batch_size or train.num_workers"
STUDY_HINT = "lower train.batch_size, resources.workers_per_trial or concurrency"

_UNPLACED_SUMMARY = (
    "worker group not placed within resources.placement_timeout_s: the cluster lacks the free resources "
    "(a node lost?); retried later"
)
_OOM = re.compile(r"running low on memory|NODE_OUT_OF_MEMORY|\bOutOfMemoryError: \d+ worker")
_OOM_USAGE = re.compile(r"was ([\d.]+)\s*GB(?: used)?\s*/\s*([\d.]+)\s*GB")
_KILLED = re.compile(r"^Selected to kill:.*?task name=([\w.:]+)", re.MULTILINE)
_GPU_OOM = re.compile(r"CUDA out of memory|torch\.OutOfMemoryError|HIP out of memory")
_NODE_LOST = re.compile(
    r"its node has died|NodeDiedError|local raylet died|interrupted by node preemption|node (?:\S+ )?(?:is )?dead"
)
_UNPLACED = re.compile(r"worker group startup timed out|WorkerGroupStartupTimeoutError|Unplaceable: trial \S+ cannot be placed")
_WORKER_DIED = re.compile(
    r"worker process has died|The worker died unexpectedly|WorkerCrashedError|"
    r"The actor died unexpectedly|exits with a connection error code|A worker health check failed"
)
_RANK = re.compile(r"\[Rank (\d+) Error Snippet\]")
_PID = re.compile(r"\bpid[:=]\s*(\d+)")
_EXIT_DETAIL = re.compile(r"Worker exit detail: (.+?)\.(?:\s|$)")
_PY_ERROR = re.compile(r"^\s*((?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt)): (.+)$", re.MULTILINE)


class TrainingError(RuntimeError):
    """A run that did not finish (worker error, non-finite loss)."""


@dataclass(frozen=True)
class Failure:
    """What happened, in one line, and whether a retry from the last checkpoint can help."""

    kind: str  # "out_of_memory" | "worker_died" | "node_lost" | "unplaced" | "gpu_out_of_memory" | "error"
    summary: str
    retryable: bool


def explain_failure(text: str, *, hint: str = TRAIN_HINT, origin: str = "the training code") -> Failure:
    """Classify the text of a failure (Ray's message, a traceback) and say it plainly.

    ``hint`` is the advice for an out-of-memory kill (which keys lower the memory use);
    ``origin`` names where a plain exception was raised ("error in <origin>: ...").
    """
    if _OOM.search(text):
        return Failure("out_of_memory", _oom_summary(text, hint), True)
    if _GPU_OOM.search(text):
        return Failure("gpu_out_of_memory", f"GPU out of memory in the training code; {hint} (or set train.amp)", False)
    if _UNPLACED.search(text):
        return Failure("unplaced", _UNPLACED_SUMMARY, True)
    if _NODE_LOST.search(text):
        return Failure("node_lost", "node lost: a Ray node running the workers died or was preempted", True)
    if _WORKER_DIED.search(text):
        return Failure("worker_died", _worker_died_summary(text), True)
    return Failure("error", _error_summary(text, origin), False)


def explain_exception(exc: BaseException, *, hint: str = TRAIN_HINT, origin: str = "the training code") -> Failure:
    """:func:`explain_failure` on :func:`failure_text` of ``exc``."""
    return explain_failure(failure_text(exc), hint=hint, origin=origin)


LOW_DISK_BYTES = 64 * 2**20  # below this much free space a failed write is most likely the full disk's


def with_disk_note(failure: Failure, folder: Path) -> Failure:
    """``failure`` with the disk named when the one holding ``folder`` (or its nearest existing parent) has
    less than :data:`LOW_DISK_BYTES` free: a full disk surfaces as whatever the failed write raised
    (torch.save's ``unexpected pos 181184 vs 181072``), which does not say so."""
    path = Path(folder)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return failure
    if free >= LOW_DISK_BYTES:
        return failure
    return Failure(failure.kind, f"{failure.summary} (the disk holding {folder} is full: {free // 1024} KiB free)", failure.retryable)


def carries_interrupt(exc: BaseException) -> bool:
    """Whether a KeyboardInterrupt (Ctrl-C, or SIGTERM through the CLI's handler) is in ``exc``'s chain.

    Code can wrap the interrupt: Python 3.11 turns one raised while a class is created (a lazy
    import) into ``RuntimeError: Error calling __set_name__ ...`` with the interrupt as its cause."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, KeyboardInterrupt):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


@contextmanager
def interrupts_unwrapped() -> Iterator[None]:
    """Re-raise an exception that carries an interrupt (:func:`carries_interrupt`) as KeyboardInterrupt,
    so that a stopped run ends KILLED, is not retried, and records no failure."""
    try:
        yield
    except Exception as exc:
        if carries_interrupt(exc):
            raise KeyboardInterrupt from exc
        raise


def failure_text(exc: BaseException) -> str:
    """The full text of ``exc``: its type, message and traceback (with Ray's worker snippets)."""
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


def record_failure(path: Path, text: str, failure: Failure, *, attempt: int) -> None:
    """Append one failure (summary, then the full text) to the run's ``error.txt``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as fh:
        fh.write(f"=== attempt {attempt}: {failure.summary} (retryable: {'yes' if failure.retryable else 'no'})\n")
        fh.write(text.rstrip() + "\n\n")


def _oom_summary(text: str, hint: str) -> str:
    usage = _OOM_USAGE.search(text)
    in_use = f", {float(usage[1]):.1f} of {float(usage[2]):.1f} GiB in use" if usage else ""
    return f"{_killed(text)}: out of memory{in_use}; {hint}"


def _killed(text: str) -> str:
    """Who Ray's memory monitor killed, from its "Selected to kill: ... task name=<Class.method>" lines."""
    names = [name.split(".")[0].split(":")[0] for name in _KILLED.findall(text)]
    if not names:
        return "worker killed"
    workers = sum(n == "RayTrainWorker" for n in names) + sum(n == "ImplicitFunc" for n in names)
    parts = [f"{workers} training worker{'s' if workers > 1 else ''}"] if workers else []
    if "TrainController" in names:
        parts.append("Ray Train's controller")
    others = [n for n in names if n not in ("RayTrainWorker", "ImplicitFunc", "TrainController")]
    if len(others) == 1:
        parts.append(f"a Ray helper ({others[0]})")
    elif others:
        parts.append(f"{len(others)} Ray helpers")
    if parts == ["1 training worker"]:
        return "worker killed"
    return (", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0]) + " killed"


def _worker_died_summary(text: str) -> str:
    rank, pid, detail = _RANK.search(text), _PID.search(text), _EXIT_DETAIL.search(text)
    who = "a worker process"
    if rank:
        who = f"worker rank {rank[1]}"
    if pid:
        who += f" (pid {pid[1]})"
    because = f" ({detail[1]})" if detail else ""
    return f"worker died: {who} exited unexpectedly{because}: killed by a signal, the kernel's OOM killer or a crash"


def _error_summary(text: str, origin: str) -> str:
    errors = _PY_ERROR.findall(text)
    for name, message in reversed(errors):  # the innermost exception is the last one raised
        if not name.startswith(("ray.", "Ray")) and name not in ("WorkerGroupError", "TrainingFailedError"):
            where = f" (worker rank {_RANK.search(text)[1]})" if _RANK.search(text) else ""
            return f"error in {origin}{where}: {name.rsplit('.', 1)[-1]}: {message.strip()}"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("Traceback")]
    return lines[0] if lines else "unknown error"
