"""On a real Ray instance: the placement group of a dead actor is found as orphaned, a live actor's
and the driver's are not (what the admission ledger removes after a node loss)."""

from __future__ import annotations

import time

import pytest

from prvrlab.platform.search.admission import _remove_placement_group, orphaned_groups

pytestmark = pytest.mark.slow


def test_only_the_group_of_a_dead_actor_is_orphaned():
    import ray
    from ray.util import placement_group, placement_group_table

    ray.init(num_cpus=2, include_dashboard=False, address="local", log_to_driver=False)
    try:

        @ray.remote(num_cpus=0)
        class Controller:  # stands for a Train controller: it makes its worker group's placement group
            def make(self) -> str:
                group = placement_group([{"CPU": 0.5}])
                ray.get(group.ready())
                return group.id.hex()

        driver_group = placement_group([{"CPU": 0.5}])  # as Tune's trial groups: made by the driver
        ray.get(driver_group.ready())
        dying, living = Controller.remote(), Controller.remote()
        lost, kept = ray.get([dying.make.remote(), living.make.remote()])
        assert orphaned_groups() == []
        ray.kill(dying)
        deadline = time.monotonic() + 30
        while not orphaned_groups() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert orphaned_groups() == [lost]
        _remove_placement_group(lost)
        assert placement_group_table()[lost]["state"] == "REMOVED"
        assert placement_group_table()[kept]["state"] == placement_group_table()[driver_group.id.hex()]["state"] == "CREATED"
        assert orphaned_groups() == []
    finally:
        ray.shutdown()
