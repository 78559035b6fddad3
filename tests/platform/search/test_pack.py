"""``resources.pack: k``: k trials' reused worker groups share one group's CPUs — the key's checks, the
per-rank share and the Tune concurrency it gives, and a packed search with the unpacked search's results."""

from __future__ import annotations

import json

import pytest

from prvrlab.platform.config import ConfigError
from prvrlab.platform.search.spec import load_search_spec
from prvrlab.platform.search.study import TRIAL_ACTOR_CPU, trial_resources
from prvrlab.platform.search.workers import POOL_LOG

from search_helpers import study_runs, tiny_spec

POOLED = {"workers_per_trial": 2, "reuse_workers": True}


# ---------------------------------------------------------------- fast


def test_pack_defaults_to_one_and_multiplies_the_trials_at_a_time(tiny_root, tmp_path):
    plain = load_search_spec(tiny_spec(tmp_path, tiny_root, name="plain", concurrency=3, resources=POOLED))
    assert plain.resources.pack == 1 and plain.slots == 3
    packed = load_search_spec(tiny_spec(tmp_path, tiny_root, name="packed", concurrency=3, resources={**POOLED, "pack": 2}))
    assert packed.resources.pack == 2 and packed.slots == 6


@pytest.mark.parametrize(
    ("resources", "message"),
    [
        ({**POOLED, "pack": 0}, r"resources\.pack: must be >= 1, got 0"),
        ({**POOLED, "pack": 1.5}, r"resources\.pack: expected an integer, got 1\.5"),
        ({"workers_per_trial": 2, "reuse_workers": False, "pack": 2},
         r"resources\.pack: 2 needs reused pools \(resources\.reuse_workers: true or auto\) and workers_per_trial > 1"),
        ({"workers_per_trial": 1, "reuse_workers": True, "pack": 2}, r"resources\.pack: 2 needs reused pools"),
        ({"workers_per_trial": 1, "pack": 2}, r"resources\.pack: 2 needs reused pools"),
        ({**POOLED, "gpus_per_worker": 1, "pack": 2}, r"resources\.pack: 2 packs CPU ranks only"),
    ],
)
def test_bad_pack_names_the_key(tiny_root, tmp_path, resources, message):
    with pytest.raises(ConfigError, match=message):
        load_search_spec(tiny_spec(tmp_path, tiny_root, name="bad", resources=resources))


def test_packed_ranks_split_one_group_share(tiny_root, tmp_path):
    def share(resources, concurrency=1, cluster=8.0):
        spec = load_search_spec(tiny_spec(tmp_path, tiny_root, name="s", concurrency=concurrency, resources=resources))
        return trial_resources(spec, cluster, 0.0)[0]

    # 8 CPUs, 2 ranks per trial, 1 x 2 trials at a time: (8 - 2 trial actors) / 4 ranks, whole CPUs
    assert share({**POOLED, "pack": 2}) == float(int((8 - 2 * TRIAL_ACTOR_CPU) / 4)) == 1.0
    assert share(POOLED, concurrency=2) == share({**POOLED, "pack": 2})  # the same ranks at a time
    # 2 CPUs, 3 x 2 ranks: below one CPU each, in hundredths
    assert share({**POOLED, "pack": 3}, cluster=2.0) == int((2 - 3 * TRIAL_ACTOR_CPU) / 6 * 100) / 100 == 0.32
    assert share({**POOLED, "cpus_per_worker": 3.0, "pack": 2}) == 1.0  # 1.5 -> whole CPUs
    assert share({**POOLED, "cpus_per_worker": 1.0, "pack": 4}) == 0.25


# ---------------------------------------------------------------- a packed search on Ray


@pytest.fixture(scope="module")
def ray_shutdown():
    yield
    import ray

    ray.shutdown()


@pytest.mark.slow
def test_packed_trials_train_side_by_side_with_the_unpacked_results(tiny_root, tmp_path, ray_shutdown):
    from prvrlab.platform.search.tuning import search

    lrs = [1e-3, 2e-3]
    results = {}
    for name, pack in (("packed", 2), ("unpacked", 1)):
        folder = tmp_path / name
        folder.mkdir()
        spec = tiny_spec(
            folder, tiny_root, name=name, resources={**POOLED, "pack": pack}, budget={"trials": 2},
            sampler={"type": "grid", "seed": 0}, space={"train.lr": {"grid": lrs}},
        )
        result = search(load_search_spec(spec, {"train.epochs": 1, "train.torch_threads": 1}), echo=None)
        assert result.counts["finished"] == 2, result.counts
        children = study_runs(folder)[1]
        results[name] = {round(float(c.data.params["train.lr"]), 8): c for c in children}
        pools = [
            json.loads((result.study_dir / "trials" / c.data.tags["prvrlab.trial_id"] / POOL_LOG).read_text().splitlines()[0])
            for c in children
        ]
        if pack == 2:  # two pools at once, each trial the first of its own
            assert len({p["pool"] for p in pools}) == 2 and all(p["trials_before"] == 0 for p in pools)
            first, second = sorted(children, key=lambda c: c.info.start_time)
            assert second.info.start_time < first.info.end_time  # trained side by side
        else:  # one pool, trials one after the other
            assert len({p["pool"] for p in pools}) == 1
    for lr in lrs:
        got, want = results["packed"][lr].data.metrics, results["unpacked"][lr].data.metrics
        compared = sorted(k for k in want if k.startswith(("train/", "val/", "final/")) and not k.startswith("final/time/"))
        assert "train/loss" in compared and "final/val/sumr" in compared
        assert {k: got[k] for k in compared} == pytest.approx({k: want[k] for k in compared}, rel=1e-5, abs=1e-6)
