"""The admission ledger: worker groups are granted only what the alive nodes hold (no Ray)."""

from __future__ import annotations

import pytest

from prvrlab.platform.failures import explain_failure
from prvrlab.platform.search.admission import (
    GROUP_GRACE_S,
    LEASE_S,
    SWEEP_S,
    AdmissionReporter,
    Ledger,
    fits_at_once,
    shortfall,
)

NEEDS = {"CPU": 2.01}  # a trial actor (0.01) + 2 workers x 1 CPU


class FakeCluster:
    """Capacity and clock a test moves by hand."""

    def __init__(self, cpus: float) -> None:
        self.cpus, self.now = cpus, 0.0

    def capacity(self) -> dict[str, float]:
        return {"CPU": self.cpus}

    def clock(self) -> float:
        return self.now


def make_ledger(cluster: FakeCluster) -> Ledger:
    return Ledger(capacity=cluster.capacity, clock=cluster.clock, orphans=list)


def test_shortfall_names_what_is_missing_and_what_is_free():
    assert shortfall({"CPU": 2.0}, {"CPU": 3.0}, {"CPU": 2.0}) == "needs 2 CPU, 1 free"
    assert shortfall({"CPU": 2.0}, {"CPU": 4.0}, {"CPU": 2.0}) is None  # exactly what is free fits
    assert shortfall({"CPU": 1.0, "GPU": 0.5}, {"CPU": 4.0}, {}) == "needs 0.5 GPU, 0 free"
    assert shortfall({"CPU": 3.0}, {"CPU": 2.0}, {"CPU": 4.0}) == "needs 3 CPU, 0 free"  # over-granted: never negative
    # how many fit at once: floor(capacity / need) of the scarcest resource
    assert fits_at_once({"CPU": 2.01}, {"CPU": 5.0}) == 2
    assert fits_at_once({"CPU": 1.0, "GPU": 1.0}, {"CPU": 8.0, "GPU": 3.0}) == 3
    assert fits_at_once({"CPU": 2.0}, {"CPU": 4.0}) == 2


def test_node_loss_lowers_concurrency_and_its_return_raises_it_again():
    cluster = FakeCluster(cpus=5.0)  # head 3 CPU + worker node 2 CPU
    ledger = make_ledger(cluster)
    assert ledger.request("a", NEEDS)["reason"] is None
    assert ledger.request("b", NEEDS)["reason"] is None
    assert ledger.request("c", NEEDS) == {"reason": f"needs 2.01 CPU, {5.0 - 2 * 2.01:g} free", "running": 2}

    cluster.cpus = 3.0  # the worker node is lost; trial b (there) is retried by Tune as b again
    ledger.release("b")
    assert ledger.request("b", NEEDS)["reason"] == f"needs 2.01 CPU, {3.0 - 2.01:g} free"
    cluster.now += 1
    ledger.release("a")  # a finished: c waited longest and goes first, b stays queued
    assert ledger.request("b", NEEDS)["reason"] == "queued behind trial c"
    assert ledger.request("c", NEEDS)["reason"] is None
    assert ledger.request("b", NEEDS)["reason"] == f"needs 2.01 CPU, {3.0 - 2.01:g} free"

    cluster.cpus = 5.0  # the node is back: b fits beside c
    assert ledger.request("b", NEEDS)["reason"] is None
    assert ledger.status()["running"] == ["b", "c"]


def test_a_grant_not_renewed_lapses_and_frees_its_resources():
    cluster = FakeCluster(cpus=3.0)
    ledger = make_ledger(cluster)
    assert ledger.request("dead", NEEDS)["reason"] is None  # its actor dies with its node: no release
    assert ledger.request("next", NEEDS)["reason"] is not None
    cluster.now += LEASE_S / 2
    assert ledger.request("next", NEEDS)["reason"] is not None  # still within the lease
    cluster.now += LEASE_S / 2 + 1
    assert ledger.request("next", NEEDS) == {"reason": None, "running": 1}
    # a renewing grant does not lapse
    for _ in range(3):
        cluster.now += LEASE_S - 1
        assert ledger.request("next", NEEDS)["reason"] is None
    assert ledger.status()["running"] == ["next"]


def test_a_retried_trial_does_not_inherit_the_grant_of_its_dead_attempt():
    cluster = FakeCluster(cpus=4.5)
    ledger = make_ledger(cluster)
    assert ledger.request("a", NEEDS, "a1")["reason"] is None
    assert ledger.request("b", NEEDS, "b1")["reason"] is None
    cluster.cpus = 2.5  # b's node is lost with b's trial actor: no release, its grant has not lapsed yet
    assert ledger.request("b", NEEDS, "b2") == {"reason": f"needs 2.01 CPU, {2.5 - 2.01:g} free", "running": 1}
    assert ledger.request("a", NEEDS, "a1")["reason"] is None  # a renews its own grant
    assert ledger.status()["running"] == ["a"]


def group_ledger(cluster: FakeCluster) -> tuple[Ledger, list[str]]:
    removed: list[str] = []
    return Ledger(capacity=cluster.capacity, clock=cluster.clock, remove_group=removed.append), removed


def test_the_worker_group_of_a_dead_attempt_is_removed_when_the_trial_is_retried():
    """Node loss: b's actor and Train controller die, Ray would reschedule b1's placement group onto
    the surviving node and hold its CPUs; b's next attempt asking removes it, a's group stays."""
    cluster = FakeCluster(cpus=4.5)
    ledger, removed = group_ledger(cluster)
    ledger.request("a", NEEDS, "a1")
    ledger.request("b", NEEDS, "b1")
    ledger.attach("a1", "pg-a1")
    ledger.attach("b1", "pg-b1")
    cluster.cpus = 2.5
    ledger.request("b", NEEDS, "b2")
    assert removed == ["pg-b1"]
    ledger.request("a", NEEDS, "a1")  # a renews: nothing of a's removed
    assert removed == ["pg-b1"]
    ledger.release("a")  # a ended: its group is removed too (Train may have done it already)
    assert removed == ["pg-b1", "pg-a1"]


def test_a_retry_after_the_lease_lapsed_still_removes_the_dead_attempts_group_and_says_so():
    """Ray notices a dead node after its health checks (~30 s here): the retry asks after b1's lease
    lapsed; b1's group must go then, not a grace period later."""
    cluster = FakeCluster(cpus=4.5)
    ledger, removed = group_ledger(cluster)
    lines: list[str] = []
    reporter = AdmissionReporter(NEEDS, lines.append)
    ledger.request("b", NEEDS, "b1")
    ledger.attach("b1", "pg-b1")
    reporter.observe(ledger.status())
    cluster.now += LEASE_S + 5
    cluster.cpus = 2.5
    assert ledger.request("b", NEEDS, "b2")["reason"] is None
    assert removed == ["pg-b1"]
    reporter.observe(ledger.status())
    assert "trial b: removed the worker group its lost attempt left holding resources" in lines
    reporter.observe(ledger.status())
    assert sum("removed the worker group" in ln for ln in lines) == 1  # said once


def test_a_lapsed_grant_keeps_its_group_for_a_grace_period_and_a_late_renewal_keeps_it():
    cluster = FakeCluster(cpus=3.0)
    ledger, removed = group_ledger(cluster)

    def advance(seconds: float, *renewing: tuple[str, str]) -> None:
        """Move the clock in steps shorter than the lease, the ``renewing`` (trial, attempt) asking each step."""
        for _ in range(int(seconds // 5)):
            cluster.now += 5
            for trial, attempt in renewing:
                ledger.request(trial, NEEDS, attempt)

    ledger.request("slow", NEEDS, "s1")
    ledger.attach("s1", "pg-s1")
    cluster.now += LEASE_S + 1  # lapsed: its CPUs are free for others, its workers may still run
    assert ledger.request("other", NEEDS, "o1")["reason"] is None
    advance(GROUP_GRACE_S / 2, ("other", "o1"))
    ledger.request("slow", NEEDS, "s1")  # a late renewal within the grace (it waits: other holds the CPUs)
    advance(2 * GROUP_GRACE_S, ("other", "o1"))
    assert removed == []  # it asked within the grace: alive

    ledger.attach("o1", "pg-o1")
    advance(LEASE_S + GROUP_GRACE_S / 2)  # other's actor died with its node; nobody retries it
    ledger.status()
    assert removed == []  # lapsed, but within the grace
    advance(GROUP_GRACE_S)
    ledger.status()
    assert removed == ["pg-o1"]


def test_a_group_attached_after_its_grant_ended_is_removed_at_once():
    cluster = FakeCluster(cpus=3.0)
    ledger, removed = group_ledger(cluster)
    ledger.request("t", NEEDS, "t1")
    ledger.release("t")
    ledger.attach("t1", "pg-late")
    assert removed == ["pg-late"]


def test_a_failing_removal_does_not_break_the_ledger():
    def boom(group: str) -> None:
        raise RuntimeError("placement group already removed")

    cluster = FakeCluster(cpus=3.0)
    ledger = Ledger(capacity=cluster.capacity, clock=cluster.clock, remove_group=boom)
    ledger.request("t", NEEDS, "t1")
    ledger.attach("t1", "pg")
    ledger.release("t")
    assert ledger.request("u", NEEDS, "u1")["reason"] is None


def test_placement_groups_of_dead_controllers_are_removed_once_and_said():
    # a node died after the controller made the worker group and before rank 0 could record it
    cluster = FakeCluster(cpus=3.0)
    orphans: list[str] = []
    removed: list[str] = []
    ledger = Ledger(capacity=cluster.capacity, clock=cluster.clock, orphans=lambda: list(orphans), remove_group=removed.append)
    lines: list[str] = []
    reporter = AdmissionReporter(NEEDS, lines.append)
    reporter.observe(ledger.status())
    assert removed == [] and lines == []

    orphans.append("aa11bb22cc33")  # a controller died
    ledger.request("a", NEEDS)  # within SWEEP_S of the last look: not looked again yet
    assert removed == []
    cluster.now += SWEEP_S
    reporter.observe(ledger.status())
    assert removed == ["aa11bb22cc33"]
    assert lines == ["removed placement group aa11bb22 of a dead worker group (its controller died)"]

    # Ray may list it until the removal is done: removed and said once only
    for _ in range(3):
        cluster.now += SWEEP_S
        reporter.observe(ledger.status())
    assert removed == ["aa11bb22cc33"] and len(lines) == 1

    # a group already gone and a GCS that does not answer do not break the ledger
    def gone(group: str) -> None:
        raise ValueError(f"placement group {group} does not exist")

    def busy() -> list[str]:
        raise TimeoutError("GCS busy")

    ledger = Ledger(capacity=cluster.capacity, clock=cluster.clock, orphans=lambda: ["dd44"], remove_group=gone)
    assert ledger.request("b", NEEDS)["reason"] is None and ledger.orphaned == ["dd44"]
    ledger = Ledger(capacity=cluster.capacity, clock=cluster.clock, orphans=busy)
    assert ledger.request("b", NEEDS)["reason"] is None and ledger.orphaned == []


def test_an_abandoned_wait_does_not_block_younger_trials():
    cluster = FakeCluster(cpus=2.5)
    ledger = make_ledger(cluster)
    ledger.request("a", NEEDS)
    assert ledger.request("gone", NEEDS)["reason"].startswith("needs")
    cluster.now += 1
    assert ledger.request("young", NEEDS)["reason"].startswith("needs")
    ledger.release("a")
    assert ledger.request("young", NEEDS)["reason"] == "queued behind trial gone"
    cluster.now += LEASE_S + 0.5  # "gone" stopped asking (its trial was stopped); young still asks
    assert ledger.request("young", NEEDS)["reason"] is None
    assert ledger.status()["waiting"] == {}


def test_reporter_says_why_trials_wait_and_when_the_cluster_changes():
    cluster = FakeCluster(cpus=5.0)
    ledger = make_ledger(cluster)
    lines: list[str] = []
    reporter = AdmissionReporter(NEEDS, lines.append)
    ledger.request("8524c98a", NEEDS)
    ledger.request("1f2e3d4c", NEEDS)
    reporter.observe(ledger.status())
    assert lines == []  # everything placed, first capacity is the baseline
    cluster.cpus = 3.0
    ledger.release("1f2e3d4c")
    ledger.request("1f2e3d4c", NEEDS)
    reporter.observe(ledger.status())
    assert lines == ["cluster now holds 3 CPU: 1 trial(s) at a time", f"trial 1f2e3d4c waiting: needs 2.01 CPU, {3.0 - 2.01:g} free"]
    reporter.observe(ledger.status())
    assert len(lines) == 2  # the same reason is said once
    cluster.cpus = 5.0
    ledger.request("1f2e3d4c", NEEDS)
    reporter.observe(ledger.status())
    assert lines[2:] == ["cluster now holds 5 CPU: 2 trial(s) at a time", "trial 1f2e3d4c placed"]


@pytest.mark.parametrize(
    "text",
    [
        "ray.train.ControllerError: Training failed due to controller error:\nThe worker group startup timed out after 30.0 seconds waiting for 2 workers.",
        "prvrlab.platform.search.admission.Unplaceable: trial 8524c98a cannot be placed: needs 2 CPU, 1 free for 60 s and no trial running",
    ],
)
def test_an_unplaced_worker_group_is_retryable(text):
    failure = explain_failure(text)
    assert failure.kind == "unplaced" and failure.retryable
    assert "placement_timeout_s" in failure.summary


def test_a_failed_worker_health_check_is_retryable():
    # Ray Train V2's text when the node of a worker was killed (seen in tests/cluster/test_node_loss.py)
    text = (
        "ray.train.WorkerGroupError: Training failed due to worker errors:\n[Rank 0 Error Snippet]:\n"
        "A worker health check failed.\nWorker info: Worker(\n  actor=Actor(RayTrainWorker, 8934f41f),\n"
        "The actor 8934f41f is unavailable: The actor is temporarily unavailable: RpcError: RPC error: "
        "recvmsg:Connection reset by peer rpc_code: 14."
    )
    failure = explain_failure(text)
    assert failure.kind == "worker_died" and failure.retryable
    assert "worker rank 0" in failure.summary
