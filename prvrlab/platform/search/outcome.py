"""What the study's driver-side pieces share: the run map, trial outcomes, interrupts, labels.

Kept free of callbacks and Tune drivers so that the MLflow callback, the
progress view and the study driver all import it without a cycle.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

from prvrlab.platform.failures import STUDY_HINT, Failure, explain_failure

STUDY_FILE = "study.json"
OUTCOME_FILE = "outcome.json"  # in a trial's files: the last result of a trial that ended (FINISHED or FAILED)
FAILED_OUTCOMES = ("nonfinite", "invalid", "error")  # trials that ended without a Tune error but count as failed
FILLED_KEY = "filled_metric"  # a final report's key naming the searched metric the trial filled in (study.MetricFiller)
INTERRUPTED = threading.Event()  # set in the driver when Ctrl-C / SIGTERM stops the study
TIME_LIMIT = threading.Event()  # set in the driver when budget.time_limit_s stops the search (time_limit.TimeLimit)


def watch_interrupts() -> None:
    """Wrap Tune's SIGINT handler so that an interrupt is also recorded in INTERRUPTED (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return
    current = signal.getsignal(signal.SIGINT)
    if getattr(current, "prvrlab_watch", False):
        return

    def handler(signum, frame) -> None:
        INTERRUPTED.set()
        if callable(current):
            current(signum, frame)
        else:
            raise KeyboardInterrupt

    handler.prvrlab_watch = True  # type: ignore[attr-defined]
    signal.signal(signal.SIGINT, handler)


class RunMap:
    """``study.json``: the parent run id and trial id -> child run id (atomic writes)."""

    def __init__(self, study_dir: str | Path) -> None:
        self.path = Path(study_dir) / STUDY_FILE
        data = json.loads(self.path.read_text()) if self.path.is_file() else {}
        self.parent: str | None = data.get("parent")
        self.trials: dict[str, str] = dict(data.get("trials", {}))
        self.closed: dict[str, str] = dict(data.get("closed", {}))
        self.meta: dict[str, Any] = dict(data.get("meta", {}))

    def save(self) -> None:
        """Write the map (temp file + rename)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        payload = {"parent": self.parent, "trials": self.trials, "closed": self.closed, "meta": self.meta}
        tmp.write_text(json.dumps(payload, indent=1, sort_keys=True))
        os.replace(tmp, self.path)


def trial_outcome(last_result: dict[str, Any] | None) -> str:
    """'finished', 'nonfinite', 'invalid' (config rejected), 'error' (an error in the training code,
    not retried) or 'early_stopped' for a trial that ended without a Tune error."""
    kind = (last_result or {}).get("kind")
    if kind == "final":
        return "finished"
    if kind in FAILED_OUTCOMES:
        return kind
    return "early_stopped"


def trial_error(trial) -> tuple[str, Failure]:
    """The full text of a trial's last failure and its plain explanation (:mod:`prvrlab.platform.failures`).

    Read from the trial's local error file, which Tune appends to (``Failure # n (occurred at ...)``
    then the error) before it calls the callbacks; else from its storage copy (``get_error``).
    """
    text = ""
    local = getattr(trial, "error_file", None)
    try:
        if local and os.path.isfile(local):
            text = Path(local).read_text(errors="replace").rsplit("Failure # ", 1)[-1].partition("\n")[2]
        else:
            exc = trial.get_error()
            text = str(exc) if exc is not None else ""
    except Exception:  # the error file may be gone after a restore
        text = ""
    if not text.strip():
        return "", Failure("error", "trial failed (no error text recorded)", False)
    return text, explain_failure(text, hint=STUDY_HINT)


def write_outcome(files: str | Path, last_result: dict[str, Any] | None) -> None:
    """Record the last result of an ended trial (its metrics, ``kind`` and ``error``; atomic write).

    Tune saves its experiment state every few seconds, so a driver killed just after a
    trial ended may restore that trial as unfinished; :func:`read_outcome` lets the trial
    report its recorded result again instead of reloading and re-evaluating its model.
    """
    kept = {
        k: v
        for k, v in (last_result or {}).items()
        if ("/" in k or k in ("kind", "error", "epoch", "lr", FILLED_KEY)) and isinstance(v, (int, float, str, bool))
    }
    path = Path(files) / OUTCOME_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(kept, sort_keys=True))
    os.replace(tmp, path)


def read_outcome(files: str | Path) -> dict[str, Any] | None:
    """The recorded last result of an ended trial, or None (not ended, or an unreadable file)."""
    path = Path(files) / OUTCOME_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("kind") else None


def format_params(params: dict[str, Any]) -> str:
    """``key=value`` pairs, floats to 3 significant digits."""
    return "  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())
