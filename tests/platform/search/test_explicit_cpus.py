"""A spec's own ``resources.cpus_per_worker`` is what each worker asks Ray for (1.5 stays 1.5, as
``train.cpus_per_worker`` does); only the shares prvrlab computes (an equal share, a packed trial's part)
are rounded to whole CPUs, or hundredths below one."""

from __future__ import annotations

import pytest

from prvrlab.platform.search.spec import load_search_spec
from prvrlab.platform.search.study import trial_resources

from search_helpers import tiny_spec


@pytest.mark.parametrize("cpus", [1.5, 0.555, 2.0, 0.25])
def test_an_explicit_cpu_count_is_asked_for_as_written(tiny_root, tmp_path, cpus):
    spec = load_search_spec(tiny_spec(tmp_path, tiny_root, resources={"workers_per_trial": 1, "cpus_per_worker": cpus}))
    assert trial_resources(spec, 8.0, 0.0) == (cpus, 0.0)
    assert trial_resources(spec, 8.0, 0.0, whole=False) == (cpus, 0.0)


def test_a_computed_share_is_still_rounded(tiny_root, tmp_path):
    spec = load_search_spec(tiny_spec(tmp_path, tiny_root, concurrency=2, resources={"workers_per_trial": 1}))
    assert trial_resources(spec, 3.0, 0.0) == (1.0, 0.0)  # 1.5 each: whole CPUs
