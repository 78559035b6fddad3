"""Study resources the cluster cannot hold are refused with one line naming the key, exit 2, before any
study folder or MLflow run exists (``--check`` included); no Ray is started (the cluster is described)."""

from __future__ import annotations

import pytest

from prvrlab.platform.cli import EXIT_BAD_INPUT, main
from prvrlab.platform.search import study as study_module
from prvrlab.platform.search.spec import StudyError, load_search_spec
from prvrlab.platform.search.study import TRIAL_ACTOR_CPU, trial_resources

from search_helpers import tiny_spec

CPUS = 2
SHARED_BATCH = {"train.batch_size": 192}  # divisible by 3 and 64 workers: the batch check passes, the cluster's is tested


@pytest.fixture
def two_cpus(monkeypatch):
    """This machine is a 2-CPU, GPU-less cluster; no Ray cluster is joined or started."""
    from prvrlab.platform import runtime

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray must not start")

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(study_module, "local_cluster", lambda: {"CPU": float(CPUS), "GPU": 0.0}, raising=False)
    monkeypatch.setattr(runtime, "ensure_ray", no_ray)


@pytest.mark.parametrize(
    ("resources", "words"),
    [
        ({"workers_per_trial": CPUS + 1}, ["resources.workers_per_trial=3", "at least 3 CPUs", f"has {CPUS} CPUs"]),
        ({"workers_per_trial": 64}, ["resources.workers_per_trial=64", "at least 64 CPUs", f"has {CPUS} CPUs"]),
        (
            {"workers_per_trial": 2, "cpus_per_worker": 1},
            ["resources.cpus_per_worker=1 x resources.workers_per_trial=2", f"needs {2 + TRIAL_ACTOR_CPU:g} CPUs"],
        ),
        ({"workers_per_trial": 1, "gpus_per_worker": 0.25}, ["resources.gpus_per_worker=0.25", "0.25 with resources.workers_per_trial=1", "has 0 GPUs"]),
    ],
)
def test_a_trial_the_cluster_cannot_hold_is_refused(tiny_root, tmp_path, resources, words):
    spec = load_search_spec(tiny_spec(tmp_path, tiny_root, resources=resources, overrides=SHARED_BATCH))
    with pytest.raises(StudyError) as info:
        trial_resources(spec, float(CPUS), 0.0)
    assert str(info.value).startswith(f"{spec.path}: ") and all(w in str(info.value) for w in words), info.value


def test_ddp_gpus_beyond_the_cluster_are_refused(tiny_root, tmp_path):
    spec = load_search_spec(tiny_spec(tmp_path, tiny_root, resources={"workers_per_trial": 2, "gpus_per_worker": 1}))
    with pytest.raises(StudyError, match=r"resources\.gpus_per_worker=1 needs 1 GPU per worker, 2 with resources\.workers_per_trial=2; the cluster has 1 GPUs"):
        trial_resources(spec, 8.0, 1.0)
    assert trial_resources(spec, 8.0, 2.0) == ((8.0 - TRIAL_ACTOR_CPU) // 2, 1.0)


def test_one_worker_per_cpu_still_runs(tiny_root, tmp_path):
    spec = load_search_spec(tiny_spec(tmp_path, tiny_root, resources={"workers_per_trial": CPUS}))
    assert trial_resources(spec, float(CPUS), 0.0) == (int((CPUS - TRIAL_ACTOR_CPU) / CPUS * 100) / 100, 0.0)


def test_concurrency_below_ray_resolution_names_concurrency(tiny_root, tmp_path):
    slots = int(CPUS / 0.01) + 1  # one-worker trials: each would get under 0.01 CPU
    spec = load_search_spec(tiny_spec(tmp_path, tiny_root, concurrency=slots))
    with pytest.raises(StudyError, match=rf"concurrency: {slots} trials of 1 worker\(s\) at a time .* {CPUS} CPUs"):
        trial_resources(spec, float(CPUS), 0.0)


def _nothing_recorded(tmp_path) -> None:
    assert not (tmp_path / "mlflow.db").exists()
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("command", ["search", "ablate"])
@pytest.mark.parametrize("check", [True, False])
def test_cli_refuses_before_any_run(tiny_root, tmp_path, capsys, two_cpus, command, check):
    import ray

    fields = {"variants": {"base": {}}, "baseline": "base", "seeds": [0]} if command == "ablate" else {}
    path = tiny_spec(tmp_path, tiny_root, resources={"workers_per_trial": 64}, overrides=SHARED_BATCH, **fields)
    assert main([command, str(path), *(["--check"] if check else [])]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err, err
    assert "resources.workers_per_trial=64" in err and f"the cluster has {CPUS} CPUs" in err, err
    _nothing_recorded(tmp_path)
    assert not ray.is_initialized()


def test_check_accepts_what_fits(tiny_root, tmp_path, capsys, two_cpus):
    path = tiny_spec(tmp_path, tiny_root, resources={"workers_per_trial": CPUS})
    assert main(["search", str(path), "--check"]) == 0
    assert "valid search spec" in capsys.readouterr().out


def test_check_without_the_cluster_does_not_join_it(tiny_root, tmp_path, capsys, monkeypatch):
    import ray

    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")  # unreachable: joining it would fail
    path = tiny_spec(tmp_path, tiny_root, resources={"workers_per_trial": 64}, overrides=SHARED_BATCH)
    assert main(["search", str(path), "--check"]) == 0
    assert not ray.is_initialized()


def test_a_running_cluster_is_not_refused_up_front(tiny_root, tmp_path, two_cpus, monkeypatch):
    """Nodes may join a running cluster (an autoscaler adds them): a trial that never fits fails at run time,
    with its reason, after resources.placement_timeout_s (tests/cluster/test_node_loss.py)."""
    import ray

    spec = load_search_spec(tiny_spec(tmp_path, tiny_root, resources={"workers_per_trial": 64}, overrides=SHARED_BATCH))
    with pytest.raises(StudyError):
        study_module.check_cluster(spec)  # this machine, where the study would start its own Ray
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    study_module.check_cluster(spec)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    study_module.check_cluster(spec)


def test_on_a_growing_cluster_the_shares_are_computed_and_only_a_gpu_less_cluster_is_refused(tiny_root, tmp_path):
    spec = load_search_spec(tiny_spec(tmp_path, tiny_root, resources={"workers_per_trial": 2, "cpus_per_worker": 1}))
    with pytest.raises(StudyError):
        trial_resources(spec, float(CPUS), 0.0)
    assert trial_resources(spec, float(CPUS), 0.0, whole=False) == (1.0, 0.0)  # 2.01 CPUs: waits, then fails with its reason
    gpu = load_search_spec(tiny_spec(tmp_path, tiny_root, resources={"workers_per_trial": 1, "gpus_per_worker": 1}))
    with pytest.raises(StudyError, match="the cluster has 0 GPUs"):
        trial_resources(gpu, float(CPUS), 0.0, whole=False)
