"""The admission ledger: worker groups are granted only what the alive nodes hold (no Ray)."""

from __future__ import annotations

import pytest

from prvrlab.platform.failures import explain_failure
from prvrlab.platform.search.admission import LEASE_S, AdmissionReporter, Ledger, fits_at_once, shortfall

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
    return Ledger(capacity=cluster.capacity, clock=cluster.clock)


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
