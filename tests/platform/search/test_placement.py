"""The placement timeout of the trials Tune places (``prvrlab.platform.search.placement``): the watch's rule
on made-up trials and clocks, then searches whose pooled or one-worker trial the cluster cannot hold."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from prvrlab.platform.failures import TrainingError
from prvrlab.platform.search.placement import PlacementWatch, Unplaced

from search_helpers import study_runs, tiny_spec

NEEDS = {"CPU": 2.01, "GPU": 0}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def trial(trial_id: str, status: str):
    return SimpleNamespace(trial_id=trial_id, status=status, placement_group_factory=SimpleNamespace(required_resources=NEEDS))


def make_watch(clock: Clock, waiting: list[int], free: dict[str, float] | None = None, timeout_s: float = 5.0):
    asked: list[float] = []

    def count() -> int:
        asked.append(clock.now)
        return waiting[0]

    return PlacementWatch(timeout_s=timeout_s, waiting=count, free=lambda: dict(free or {"CPU": 2.0}), clock=clock, poll_s=1.0), asked


def test_a_pending_trial_with_nothing_running_stops_the_study_after_the_timeout():
    clock, waiting = Clock(), [1]
    watch, asked = make_watch(clock, waiting)
    stalled = [trial("a_00000", "TERMINATED"), trial("a_00001", "PENDING")]
    watch.observe(stalled)  # first seen stalled at 100
    for now in (101.0, 103.0, 105.0):  # 5 s waited: not more than the timeout
        clock.now = now
        watch.observe(stalled)
    clock.now = 105.5
    watch.observe(stalled)  # within poll_s of the last question: not asked again
    assert asked == [100.0, 101.0, 103.0, 105.0]
    clock.now = 106.0
    with pytest.raises(Unplaced) as raised:
        watch.observe(stalled)
    text = str(raised.value)
    assert text.startswith("trial a_00001 cannot be placed: needs 2.01 CPU, 2 free for 5 s and no trial running")
    assert "resources.placement_timeout_s" in text and "--resume" in text
    assert isinstance(raised.value, TrainingError)  # the CLI's "training failed", exit status 1


def test_a_running_trial_or_a_placed_group_restarts_the_wait():
    clock, waiting = Clock(), [1]
    watch, _ = make_watch(clock, waiting)
    stalled = [trial("b_00001", "PENDING")]
    busy = [trial("b_00000", "RUNNING"), trial("b_00001", "PENDING")]  # waits its turn
    watch.observe(stalled)
    clock.now = 104.0
    watch.observe(busy)
    clock.now = 108.0
    watch.observe(stalled)  # the wait starts again here
    clock.now = 113.0
    watch.observe(stalled)  # 5 s since 108
    waiting[0] = 0  # its group is placed: the trial actor is starting, however long that takes
    clock.now = 114.0
    watch.observe(stalled)
    clock.now = 200.0
    waiting[0] = 1
    watch.observe(stalled)
    clock.now = 205.0
    watch.observe(stalled)
    clock.now = 205.5
    watch.observe([trial("b_00001", "TERMINATED")])  # nothing pending
    clock.now = 300.0
    watch.observe(stalled)
    clock.now = 306.0
    with pytest.raises(Unplaced, match=r"trial b_00001 cannot be placed: needs 2\.01 CPU, 2 free for 5 s"):
        watch.observe(stalled)


def test_a_group_that_fits_the_free_resources_but_waits_is_said_so():
    clock = Clock()
    watch, _ = make_watch(clock, [1], free={"CPU": 8.0}, timeout_s=2.0)
    stalled = [trial("c_00000", "PENDING")]
    watch.observe(stalled)
    clock.now = 103.0
    with pytest.raises(Unplaced, match=r"c_00000 cannot be placed: its placement group is not placed for 2 s"):
        watch.observe(stalled)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["pool", "one worker"])
def test_a_trial_the_cluster_cannot_hold_ends_the_search_with_its_reason(tiny_root, tmp_path, capsys, kind):
    """2 ranks of half the cluster's CPUs each on a pool, plus the trial actor's 0.01, or one worker of one CPU more
    than the cluster has: Tune alone would wait for ever."""
    import ray

    from prvrlab.platform.cli import EXIT_FAILED, main
    from prvrlab.platform.runtime import ensure_ray
    from prvrlab.platform.search.study import latest_study_dir

    ensure_ray()  # a running cluster: not refused up front (nodes may join it)
    try:
        cpus = float(ray.cluster_resources()["CPU"])
        if kind == "pool":
            resources, needs = {"workers_per_trial": 2, "cpus_per_worker": cpus / 2, "reuse_workers": True}, cpus + 0.01
        else:
            resources, needs = {"workers_per_trial": 1, "cpus_per_worker": cpus + 1}, cpus + 1
        path = tiny_spec(
            tmp_path, tiny_root, name="unplaced", budget={"trials": 2}, resources={**resources, "placement_timeout_s": 2}
        )
        start = time.monotonic()
        code = main(["search", str(path)])
        wall = time.monotonic() - start
    finally:
        ray.shutdown()
    err = capsys.readouterr().err
    assert code == EXIT_FAILED, err
    assert f"cannot be placed: needs {needs:g} CPU, {cpus:g} free for 2 s and no trial running" in err, err
    assert wall < 120, wall  # the timeout, the polls and the study's start and end, not Tune's endless wait
    (parent,), children = study_runs(tmp_path)
    assert children == []  # no trial started
    assert parent.info.status == "FAILED"
    assert parent.data.tags["prvrlab.status"] == "failed"
    assert "resources.placement_timeout_s" in parent.data.tags["prvrlab.stop_reason"]  # dropped when --resume reopens it
    from ray import tune

    study_dir = latest_study_dir(tmp_path / "results" / "search" / "unplaced")
    assert study_dir is not None and tune.Tuner.can_restore(str(study_dir / "tune"))  # --resume continues it
