"""Admission of multi-worker trials: a worker group starts only when the cluster can hold it.

Tune admits a multi-worker trial by its trial actor alone (0.01 CPU): the
Ray Train worker group the trial then starts is invisible to it, and Train
V2 places that group in a placement group of its own (not the trial's).
After a node is lost, retried trials could thus ask for more than the
remaining nodes hold and wait without end.  Tune starts every PENDING trial
whatever its scheduler says, so the gate lives where the worker group starts:

- the driver starts one :class:`Ledger` actor per study (named, 0 CPU);
- a trial asks it for its worker group's resources (``needs``) before it
  builds its ``TorchTrainer`` and waits, polling, until the alive nodes'
  resources minus those granted to running trials cover them; the reason
  it waits (``needs 2 CPU, 1 free``) is the ledger's, and the driver's
  :class:`AdmissionReporter` prints it on the console and in ``study.log``;
- a grant is a lease the trial renews while it trains: a trial whose actor
  died with its node stops renewing and its grant lapses (``LEASE_S``);
- waiting trials are served oldest first; when a node comes back the
  ledger sees the larger cluster at the next poll and grants again, so the
  search's effective concurrency follows the cluster both ways;
- a trial that waits longer than its placement timeout while no trial holds
  a grant (nothing running could ever free resources) raises
  :class:`Unplaceable`, a retryable failure: Tune retries it later, up to the
  spec's ``max_retries``, then it ends FAILED with that reason;
- rank 0 of each attempt's worker group tells the ledger its placement
  group (:func:`attach_worker_group`).  A placement group belongs to the job,
  not to the Train controller that made it: when a node dies with a trial's
  actor and controller, Ray reschedules the group's lost bundles onto the
  surviving nodes, where it holds their CPUs until the search ends, so no
  retried trial could start there.  The ledger removes an attempt's group
  when the trial's next attempt asks for its grant (a trial runs once at a
  time), when the grant is released (harmless when Train removed it
  already), or ``GROUP_GRACE_S`` after the grant lapsed (a late renewal
  within that grace keeps a slow but live trial's workers).
  Rank 0 may never get there: a node can die after the controller made the
  group and before any worker started (seen in a node-kill run: the group sat
  CREATED on the survivor, holding 2 of its 3 CPUs, and every retried worker
  group timed out beside it).  So the ledger also removes, at most every
  ``SWEEP_S``, every placement group of its job whose creating actor (a
  Train controller) is dead (:func:`orphaned_groups`); groups made by the
  driver (Tune's trial actors) have no creating actor and are never touched.

Choices where Ray gives no rule: capacity is the sum over alive nodes
(``ray.cluster_resources()``), not a per-node bin packing (Train's worker
group may span nodes; a group that still cannot be placed hits Train's
worker-group start timeout, which the study sets to the same placement
timeout and makes fatal to the trial, hence retried by Tune).
"""

from __future__ import annotations

import threading
import time
import uuid
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from prvrlab.checks import first_line

NAMESPACE = "prvrlab"
LEASE_S = 15.0  # a grant or a wait not renewed for this long lapses (its trial is gone)
POLL_S = 1.0  # how often a waiting trial asks again
RENEW_S = 3.0  # how often a running trial renews its grant
SWEEP_S = 2.0  # how often the ledger looks for placement groups of dead controllers
GROUP_GRACE_S = 60.0  # a lapsed attempt's worker group is removed this long after its grant lapsed
HEAD_NODE = "node:__internal_head__"  # the resource only Ray's head node has
_EPS = 1e-9


class Unplaceable(RuntimeError):
    """A trial's worker group cannot be placed: nothing runs that could free what it needs."""


def shortfall(needs: dict[str, float], capacity: dict[str, float], reserved: dict[str, float]) -> str | None:
    """``needs 2 CPU, 1 free`` when ``needs`` exceed ``capacity - reserved`` (per resource), else None."""
    missing = []
    for key, amount in needs.items():
        free = capacity.get(key, 0.0) - reserved.get(key, 0.0)
        if amount > 0 and amount > free + _EPS:
            missing.append(f"{amount:g} {key}, {max(free, 0.0):g} free")
    return "needs " + "; ".join(missing) if missing else None


def fits_at_once(needs: dict[str, float], capacity: dict[str, float]) -> int:
    """How many trials of ``needs`` the cluster holds at once."""
    counts = [int(capacity.get(k, 0.0) / v + _EPS) for k, v in needs.items() if v > 0]
    return min(counts) if counts else 0


class Ledger:
    """Grants of worker-group resources to trials against the cluster's capacity (pure; the Ray
    actor wraps it).  ``capacity``: the alive nodes' resources; ``clock``: seconds;
    ``remove_group``: removes a placement group by hex id (module docstring)."""

    def __init__(
        self,
        *,
        capacity: Callable[[], dict[str, float]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        lease_s: float = LEASE_S,
        group_grace_s: float = GROUP_GRACE_S,
        remove_group: Callable[[str], None] | None = None,
        orphans: Callable[[], list[str]] | None = None,
    ) -> None:
        self._capacity = capacity or _cluster_resources
        self._remove_group = remove_group or _remove_placement_group
        self._clock = clock
        self._lease_s, self._group_grace_s = lease_s, group_grace_s
        self.granted: dict[str, tuple[dict[str, float], float, str]] = {}  # trial -> (needs, last renewal, attempt)
        self.waiting: dict[str, dict[str, Any]] = {}  # trial -> {needs, seen, reason}, oldest first
        self.groups: dict[str, list[str]] = {}  # attempt -> its worker group's placement group ids
        self.owners: dict[str, str] = {}  # attempt -> its trial
        self.cleaned: list[str] = []  # trials whose dead attempt's worker group the ledger removed
        self.lapsed: dict[str, float] = {}  # attempt whose grant lapsed -> when
        self._orphans = orphans or orphaned_groups
        self._swept = -float("inf")
        self.orphaned: list[str] = []  # placement groups of dead controllers removed, in order

    def _expire(self, now: float) -> None:
        for g in self.granted.values():
            if now - g[1] > self._lease_s:
                self.lapsed.setdefault(g[2], g[1] + self._lease_s)  # when it lapsed
        self.granted = {t: g for t, g in self.granted.items() if now - g[1] <= self._lease_s}
        self.waiting = {t: w for t, w in self.waiting.items() if now - w["seen"] <= self._lease_s}
        for attempt, since in list(self.lapsed.items()):
            if now - since > self._group_grace_s:
                self._drop_groups(attempt, dead=True)
        if now - self._swept >= SWEEP_S:
            self._swept = now
            self.sweep()

    def sweep(self) -> list[str]:
        """Remove the placement groups whose creating actor is dead; returns their ids."""
        try:
            found = [g for g in self._orphans() if g not in self.orphaned]
        except Exception:  # the GCS busy after a node loss: the next sweep looks again
            return []
        for group in found:
            try:
                self._remove_group(group)
            except Exception:  # removed meanwhile (by rank 0's record, its job, or Ray)
                pass
            self.orphaned.append(group)
        return found

    def _drop_groups(self, attempt: str, *, dead: bool) -> None:
        self.lapsed.pop(attempt, None)
        owner, groups = self.owners.pop(attempt, None), self.groups.pop(attempt, [])
        if dead and groups and owner is not None:
            self.cleaned.append(owner)
        for group in groups:
            try:
                self._remove_group(group)
            except Exception:  # already gone with its job or removed by Train: nothing holds resources
                pass

    def attach(self, attempt: str, group: str) -> None:
        """Record placement group ``group`` (hex id) as held by ``attempt``'s worker group."""
        owner = next((t for t, g in self.granted.items() if g[2] == attempt), None)
        if owner is not None:
            self.groups.setdefault(attempt, []).append(group)
            self.owners[attempt] = owner
        else:  # its grant lapsed or was released before rank 0 got here
            self._remove_group(group)

    def reserved(self) -> dict[str, float]:
        """Resources granted to running trials, summed."""
        total: dict[str, float] = {}
        for needs, _, _ in self.granted.values():
            for key, amount in needs.items():
                total[key] = total.get(key, 0.0) + amount
        return total

    def request(self, trial_id: str, needs: dict[str, float], attempt: str = "") -> dict[str, Any]:
        """Ask for (or renew) ``needs``: ``{"reason": None | why it waits, "running": grants held}``.

        ``attempt`` tells a trial's attempts apart: a retried trial asking while the grant of
        its dead attempt has not lapsed yet replaces that grant (a trial runs once at a time).
        """
        now = self._clock()
        self.lapsed.pop(attempt, None)  # it asks, so it lives: a late renewal keeps its workers
        for earlier in [a for a, t in self.owners.items() if t == trial_id and a != attempt]:
            self._drop_groups(earlier, dead=True)  # a trial runs once at a time: that attempt is dead
        self._expire(now)
        if trial_id in self.granted:
            held, _, holder = self.granted.pop(trial_id)
            if holder == attempt:
                self.granted[trial_id] = (held, now, attempt)
                return {"reason": None, "running": len(self.granted)}
        capacity, reserved = self._capacity(), self.reserved()
        wait = self.waiting.setdefault(trial_id, {"needs": dict(needs), "reason": None})
        wait["seen"] = now
        reason = shortfall(needs, capacity, reserved)
        if reason is None:  # oldest first: an older waiter that fits goes before this one
            queue = list(self.waiting)  # in order of arrival
            older = [t for t in queue[: queue.index(trial_id)] if shortfall(self.waiting[t]["needs"], capacity, reserved) is None]
            if older:
                reason = f"queued behind trial {older[0]}"
        if reason is None:
            del self.waiting[trial_id]
            self.granted[trial_id] = (dict(needs), now, attempt)
        else:
            wait["reason"] = reason
        return {"reason": reason, "running": len(self.granted)}

    def release(self, trial_id: str) -> None:
        """Give back a trial's grant (or stop its wait); its worker group's placement group goes too."""
        grant = self.granted.pop(trial_id, None)
        self.waiting.pop(trial_id, None)
        if grant is not None:
            self._drop_groups(grant[2], dead=False)

    def status(self) -> dict[str, Any]:
        """``{"capacity", "running": [trial ids], "waiting": {trial id: reason}, "cleaned": [trial ids whose
        dead attempt's worker group was removed, in order]}`` (for the driver)."""
        self._expire(self._clock())
        return {
            "capacity": self._capacity(),
            "running": sorted(self.granted),
            "waiting": {t: w["reason"] for t, w in self.waiting.items()},
            "cleaned": list(self.cleaned),
            "orphaned": list(self.orphaned),
        }


def _cluster_resources() -> dict[str, float]:
    import ray

    return {k: float(v) for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU")}


def _job_groups() -> Iterator[Any]:
    """The GCS records (``PlacementGroupTableData``) of this job's placement groups that Ray keeps.

    Ray's public placement-group table leaves the creator and the job out, so this reads the
    records the table is made from.
    """
    import ray

    if not ray.is_initialized():
        return
    from ray._private.state import state
    from ray.core.generated import gcs_pb2

    job = ray.get_runtime_context().get_job_id()
    for raw in state._connect_and_get_accessor().get_placement_group_table():
        data = gcs_pb2.PlacementGroupTableData.FromString(raw)
        if data.state != gcs_pb2.PlacementGroupTableData.REMOVED and data.creator_job_id.hex() == job:
            yield data


def orphaned_groups() -> list[str]:
    """Ids (hex) of this job's placement groups whose creating actor is dead: worker groups of Train
    controllers lost with their node or their trial actor."""
    import ray

    found = []
    for data in _job_groups():
        made_by_actor = not ray.ActorID(data.creator_actor_id).is_nil()  # a driver's group counts as "actor dead"
        if made_by_actor and data.creator_actor_dead and not data.is_detached:
            found.append(data.placement_group_id.hex())
    return found


def waiting_groups() -> int:
    """This job's placement groups made by its driver (Tune's, one per trial; not a Train controller's
    worker group) that wait for resources: not yet placed, or being placed again after a node loss."""
    import ray
    from ray.core.generated import gcs_pb2

    waiting = (gcs_pb2.PlacementGroupTableData.PENDING, gcs_pb2.PlacementGroupTableData.RESCHEDULING)
    return sum(1 for data in _job_groups() if data.state in waiting and ray.ActorID(data.creator_actor_id).is_nil())


def _remove_placement_group(group: str) -> None:
    import ray
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(group))))


def attach_worker_group(ledger_name: str, attempt: str) -> None:
    """In rank 0 of a Train worker group: tell the ledger which placement group this attempt holds."""
    import ray
    from ray.util.placement_group import get_current_placement_group

    group = get_current_placement_group()
    if group is not None:
        ray.get(ray.get_actor(ledger_name, namespace=NAMESPACE).attach.remote(attempt, group.id.hex()))


def start_ledger(name: str):
    """Start (or find) the study's named ledger actor on the head node (which outlives worker
    nodes); returns its handle."""
    import ray

    actor = ray.remote(num_cpus=0, max_restarts=-1, resources={HEAD_NODE: 0.001})(Ledger)
    return actor.options(name=name, namespace=NAMESPACE, get_if_exists=True).remote()


def stop_ledger(name: str) -> None:
    """Kill the study's ledger actor, if it runs."""
    import ray

    if not ray.is_initialized():
        return
    try:
        ray.kill(ray.get_actor(name, namespace=NAMESPACE))
    except ValueError:
        pass


@contextmanager
def admitted(name: str, trial_id: str, needs: dict[str, float], *, timeout_s: float, poll_s: float = POLL_S) -> Iterator[str]:
    """Wait until the ledger ``name`` grants ``needs`` to ``trial_id``; hold (renew) the grant inside.
    Yields the attempt's id (for :func:`attach_worker_group`)."""
    import ray

    ledger = ray.get_actor(name, namespace=NAMESPACE)
    attempt = uuid.uuid4().hex
    start = time.monotonic()
    while True:
        answer = ray.get(ledger.request.remote(trial_id, needs, attempt))
        if answer["reason"] is None:
            break
        if answer["running"] == 0 and time.monotonic() - start > timeout_s:
            raise Unplaceable(f"trial {trial_id} cannot be placed: {answer['reason']} for {timeout_s:g} s and no trial running")
        time.sleep(poll_s)
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(RENEW_S):
            ledger.request.remote(trial_id, needs, attempt)

    renewer = threading.Thread(target=renew, name="prvrlab-admission", daemon=True)
    renewer.start()
    try:
        yield attempt
    finally:
        stop.set()
        renewer.join()
        ledger.release.remote(trial_id)


class AdmissionReporter:
    """Driver side: says why trials wait and how many fit at once, when that changes.

    ``say`` writes one line (the console and the study log); feed it each
    :meth:`Ledger.status` with :meth:`observe`.
    """

    def __init__(self, needs: dict[str, float], say: Callable[[str], None]) -> None:
        self.needs, self.say = needs, say
        self._reasons: dict[str, str] = {}
        self._fits: int | None = None
        self._cleaned = 0
        self._orphaned = 0  # placement groups of dead controllers said so far

    def observe(self, state: dict[str, Any]) -> None:
        """Report what changed since the last state."""
        fits = fits_at_once(self.needs, state["capacity"])
        if fits != self._fits:
            if self._fits is not None:
                self.say(f"cluster now holds {_format(state['capacity'])}: {fits} trial(s) at a time")
            self._fits = fits
        for trial_id, reason in state["waiting"].items():
            if reason and self._reasons.get(trial_id) != reason:
                self.say(f"trial {trial_id} waiting: {reason}")
        for trial_id in set(self._reasons) - set(state["waiting"]):
            if trial_id in state["running"]:
                self.say(f"trial {trial_id} placed")
        self._reasons = {t: r for t, r in state["waiting"].items() if r}
        for trial_id in state.get("cleaned", [])[self._cleaned :]:
            self.say(f"trial {trial_id}: removed the worker group its lost attempt left holding resources")
        self._cleaned = len(state.get("cleaned", []))
        for group in state.get("orphaned", [])[self._orphaned :]:
            self.say(f"removed placement group {group[:8]} of a dead worker group (its controller died)")
        self._orphaned = max(self._orphaned, len(state.get("orphaned", [])))


class LedgerPoller:
    """Asks the ledger actor for its status without blocking the caller (Tune's event loop):
    one request in flight, answered at a later :meth:`poll`, at most every ``every_s``."""

    def __init__(self, ledger, reporter: AdmissionReporter, every_s: float = 2.0) -> None:
        self.ledger, self.reporter, self.every_s = ledger, reporter, every_s
        self._pending = None
        self._sent = -float("inf")
        self._error: str | None = None

    def poll(self) -> None:
        """Hand a ready answer to the reporter; send the next request when due."""
        import ray

        if self._pending is not None:
            ready, _ = ray.wait([self._pending], timeout=0)
            if not ready:
                return
            try:
                self.reporter.observe(ray.get(ready[0]))
                self._error = None
            except Exception as exc:  # the ledger restarting after its node died: said once
                error = first_line(exc)  # an empty message had been an IndexError
                if error != self._error:
                    self.reporter.say(f"admission status unavailable: {error}")
                self._error = error
            self._pending = None
        if time.monotonic() - self._sent >= self.every_s:
            self._pending, self._sent = self.ledger.status.remote(), time.monotonic()


def _format(resources: dict[str, float]) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in sorted(resources.items())) or "nothing"
