"""Live progress inside an epoch: batches done / total, loss, rate, ETA.

Rank 0 of the training loop measures (:class:`EpochTicker`); its session
passes each state on (in-process: a callback; under Ray: a small JSON file
``progress.json`` in the run folder, rewritten at most once a second, which
the driver polls).  The driver renders it (:class:`LiveLine`): on a terminal
one line redrawn in place, otherwise a plain line every
``$PRVRLAB_PROGRESS_S`` seconds (default 10) so that a log file reads
sensibly — no carriage returns.  Ray's worker output never reaches the
console (``log_to_driver=False``), hence the file.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, TextIO

from prvrlab.files import replace_atomically
from prvrlab.platform.errors import ConfigError

PROGRESS_FILE = "progress.json"
EVERY_S_ENV = "PRVRLAB_PROGRESS_S"
DEFAULT_EVERY_S = 10.0  # seconds between plain progress lines (not a terminal)
TTY_REDRAW_S = 0.25  # at most this often on a terminal
FILE_EVERY_S = 1.0  # a worker rewrites its progress file at most this often
LOSS_EVERY_S = TTY_REDRAW_S  # rank 0 reads its running loss from the device at most this often


def every_s_from_env() -> float:
    """``$PRVRLAB_PROGRESS_S`` as a non-negative float (default 10 s); ConfigError naming it when not a number."""
    raw = os.environ.get(EVERY_S_ENV, "")
    try:
        value = float(raw) if raw.strip() else DEFAULT_EVERY_S
    except ValueError:
        raise ConfigError(f"{EVERY_S_ENV}={raw!r}: expected a number of seconds") from None
    return max(0.0, value)


class EpochTicker:
    """Rank 0's view of one epoch (``epoch`` counted from 1): batches done, mean loss so far, batches per second, ETA.

    ``clock`` is injectable for tests; ``emit`` receives a plain dict per step.
    """

    def __init__(
        self, *, epoch: int, epochs: int, total: int, emit: Callable[[dict[str, Any]], None],
        clock: Callable[[], float] = time.monotonic, loss_every_s: float = LOSS_EVERY_S,
    ) -> None:
        self.epoch, self.epochs, self.total, self.emit, self.clock = epoch, epochs, total, emit, clock
        self.loss_every_s = loss_every_s
        self.t0 = clock()
        self.done = 0
        self.loss, self.loss_at = math.nan, -math.inf

    def step(self, mean_loss: Callable[[], float]) -> None:
        """One more batch done; ``mean_loss()``: this rank's mean loss over the epoch so far.

        It is called at most every ``loss_every_s`` and at the epoch's last batch (on a GPU each
        call waits for the queued steps); the states in between repeat the last value."""
        self.done += 1
        now = self.clock()
        if now - self.loss_at >= self.loss_every_s or self.done >= self.total:
            self.loss, self.loss_at = float(mean_loss()), now
        elapsed = now - self.t0
        rate = self.done / elapsed if elapsed > 0 else 0.0
        self.emit(
            {
                "epoch": self.epoch,
                "epochs": self.epochs,
                "batch": self.done,
                "batches": self.total,
                "loss": self.loss,
                "rate": rate,
                "elapsed_s": elapsed,
                "eta_s": (self.total - self.done) / rate if rate > 0 else None,
            }
        )


def _duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def format_progress(state: dict[str, Any]) -> str:
    """``epoch 2/12  batch 37/120  31%  loss 0.8421  1.9 batch/s  ETA 44s`` (``epoch`` counts from 1, as in reports)."""
    done, total = int(state["batch"]), int(state["batches"])
    pct = 100.0 * done / total if total else 0.0
    rate = float(state.get("rate") or 0.0)
    return (
        f"epoch {int(state['epoch'])}/{state['epochs']}  batch {done}/{total}  {pct:3.0f}%  "
        f"loss {float(state['loss']):.4f}  {rate:.2f} batch/s  ETA {_duration(state.get('eta_s'))}"
    )


def short_progress(state: dict[str, Any]) -> str:
    """``epoch 2/12 31%`` for the search/ablation view."""
    total = int(state["batches"])
    pct = 100.0 * int(state["batch"]) / total if total else 0.0
    return f"epoch {int(state['epoch'])}/{state['epochs']} {pct:.0f}% (ETA {_duration(state.get('eta_s'))})"


def write_progress(path: Path, state: dict[str, Any]) -> None:
    """Replace ``path`` with ``state`` as JSON (atomically: readers never see half a file)."""
    text = json.dumps(state)
    replace_atomically(path, lambda tmp: tmp.write_text(text))


def read_progress(path: Path) -> dict[str, Any] | None:
    """The state in ``path``, or None when it is missing or unreadable."""
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) and {"epoch", "batch", "batches"} <= set(state) else None


class FileProgress:
    """A worker-side sink: ``progress.json`` rewritten at most every ``every_s`` (and at an epoch's last batch)."""

    def __init__(self, path: Path, every_s: float = FILE_EVERY_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.path, self.every_s, self.clock = Path(path), every_s, clock
        self.last = -math.inf

    def __call__(self, state: dict[str, Any]) -> None:
        now = self.clock()
        if now - self.last < self.every_s and state["batch"] < state["batches"]:
            return
        self.last = now
        try:
            write_progress(self.path, state)
        except OSError:
            pass  # progress is a courtesy: never fail training for it


class LiveLine:
    """Renders progress states on the driver's console.

    Terminal: one line redrawn in place (``\\r``), at most every 0.25 s,
    erased by :meth:`clear` before any other output.  Not a terminal: a
    plain line when ``every_s`` seconds passed since the epoch started or
    since the last line, so a log file gets one line per ``every_s``.
    """

    def __init__(self, stream: TextIO | None = None, *, tty: bool | None = None, every_s: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self.every_s = every_s_from_env() if every_s is None else every_s
        self.clock = clock
        self.last = -math.inf
        self.shown = False  # a terminal line is on screen
        self.epoch: int | None = None
        self.seen: tuple[int, int] | None = None  # (epoch, batch) of the last state rendered

    def update(self, state: dict[str, Any] | None) -> None:
        """Show ``state`` if it is time to (a state already rendered is not shown again)."""
        if state is None or (state["epoch"], state["batch"]) == self.seen:
            return
        now = self.clock()
        if state["epoch"] != self.epoch:
            self.epoch, self.last = state["epoch"], now if not self.tty else -math.inf
            if not self.tty and self.every_s > 0:
                return
        wait = TTY_REDRAW_S if self.tty else self.every_s
        if now - self.last < wait:
            return
        self.last, self.seen = now, (state["epoch"], state["batch"])
        line = format_progress(state)
        if self.tty:
            self.stream.write(f"\r{line}\033[K")
            self.shown = True
        else:
            self.stream.write(f"  {line}\n")
        self.stream.flush()

    def clear(self) -> None:
        """Erase the terminal line (before the epoch line or any other output)."""
        if self.shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self.shown = False
