"""The placement timeout of the trials Tune places (``resources.placement_timeout_s``).

Tune asks for one placement group per trial: a one-worker trial's CPUs (and
GPU share), or, for a trial on a reused pool (:mod:`.workers`), its trial
actor's bundle and one bundle per rank.  Tune keeps a trial whose group the
cluster cannot hold PENDING, without a limit and with no word beyond a
warning in ``study.log``; a running cluster is not checked up front (nodes
may join it).  So the driver runs a :class:`PlacementWatch`: once
a trial has waited for its group longer than the placement timeout while no
trial of the study runs (nothing running could free what it needs), the study
stops with :class:`Unplaced`, naming the trial, what it needs and what is
free.  Tune's state is saved every few seconds with that trial still pending,
so ``--resume`` continues the study once the cluster can hold it.  While a
trial runs, a pending one waits its turn, as in Tune's queue.

A multi-worker trial with a worker group of its own (``reuse_workers: false``)
holds only its trial actor's 0.01 CPU in Tune's group: its worker group has
the same timeout at the admission ledger (:mod:`.admission`), where the trial
fails (retryable) and the search goes on to its next trial, which waits as
long.  Here nothing the study does next could be placed either, so it ends
at once.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from ray.tune import Callback

from prvrlab.platform.failures import TrainingError
from prvrlab.platform.search.admission import POLL_S, shortfall, waiting_groups

WAITING, RUNNING = "PENDING", "RUNNING"


class Unplaced(TrainingError):
    """No trial of a study was placed within ``resources.placement_timeout_s`` while none ran."""


def free_resources() -> dict[str, float]:
    """What the cluster's alive nodes have free now."""
    import ray

    return {key: float(value) for key, value in ray.available_resources().items()}


class PlacementWatch(Callback):
    """Raises :class:`Unplaced` from Tune's loop once a trial has been PENDING with its placement group
    unplaced and no trial RUNNING for longer than ``timeout_s`` (module docstring).

    ``waiting``: how many of the driver's (Tune's) placement groups wait for resources (asked at most every
    ``poll_s``, only while a trial is pending and none runs: a pending trial whose group is placed is
    only starting its actor); ``free``: the cluster's free resources, for the message."""

    def __init__(
        self,
        *,
        timeout_s: float,
        waiting: Callable[[], int] = waiting_groups,
        free: Callable[[], dict[str, float]] = free_resources,
        clock: Callable[[], float] = time.monotonic,
        poll_s: float = POLL_S,
    ) -> None:
        self.timeout_s, self.poll_s = float(timeout_s), float(poll_s)
        self._waiting, self._free, self._clock = waiting, free, clock
        self._since: float | None = None  # when the study was first seen stalled
        self._asked = float("-inf")  # when ``waiting`` was last asked

    def on_step_begin(self, iteration: int, trials: list[Any], **info) -> None:
        """Check the trials at each step of Tune's loop."""
        self.observe(trials)

    def observe(self, trials: list[Any]) -> None:
        """Note whether the study is stalled; raise :class:`Unplaced` once it has been for ``timeout_s``."""
        statuses = {t.status for t in trials}
        if RUNNING in statuses or WAITING not in statuses:
            self._since = None
            return
        now = self._clock()
        if now - self._asked < self.poll_s:
            return
        self._asked = now
        if self._waiting() == 0:  # the pending trial's group is placed: its actor is starting
            self._since = None
            return
        if self._since is None:
            self._since = now
            return
        if now - self._since > self.timeout_s:
            trial = next(t for t in trials if t.status == WAITING)
            needs = {k: float(v) for k, v in trial.placement_group_factory.required_resources.items() if v}
            reason = shortfall(needs, self._free(), {}) or "its placement group is not placed"
            raise Unplaced(
                f"trial {trial.trial_id} cannot be placed: {reason} for {self.timeout_s:g} s and no trial running "
                "(resources.placement_timeout_s); the study stopped with its state saved: --resume continues it "
                "once the cluster can hold the trial"
            )
