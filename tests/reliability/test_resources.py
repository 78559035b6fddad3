"""Training that asks for more than the cluster has fails at once, before any MLflow run."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from prvrlab.platform.cli import EXIT_BAD_INPUT, main
from prvrlab.platform.tracking.store import Tracker

from train_helpers import small_raw


@pytest.fixture(scope="module", autouse=True)
def _ray_down_after():
    yield
    import ray

    ray.shutdown()


def recorded_runs(raw: dict) -> list:
    if not Path(raw["tracking"]["uri"][len("sqlite:///") :]).exists():
        return []
    tracker = Tracker(raw["tracking"]["uri"], raw["tracking"]["experiment"])
    return tracker.client.search_runs([tracker.experiment_id])


@pytest.mark.slow
@pytest.mark.parametrize(
    "override, words",
    [
        ("train.cpus_per_worker=64", ["train.cpus_per_worker", "64", "CPU"]),
        ("train.use_gpu=true", ["train.use_gpu", "GPU", "0"]),
    ],
)
def test_impossible_request_fails_fast(tiny_root, tmp_path, capsys, override, words):
    raw = small_raw(tiny_root, tmp_path)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    assert main(["train", str(cfg), "--set", override]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(w in err for w in words), err
    assert "the cluster has" in err
    assert recorded_runs(raw) == []


@pytest.mark.parametrize(
    "train, cluster, words",
    [
        ({"num_workers": 3, "batch_size": 15}, {"CPU": 2.0}, ["train.num_workers=3 needs at least 3 CPUs", "the cluster has 2 CPUs"]),
        ({"num_workers": 2, "cpus_per_worker": 1.5}, {"CPU": 2.0}, ["train.cpus_per_worker=1.5 x train.num_workers=2 needs 3 CPUs"]),
        ({"num_workers": 2, "use_gpu": True}, {"CPU": 8.0, "GPU": 1.0}, ["train.use_gpu=true needs 1 GPU per worker, 2 with train.num_workers=2", "has 1 GPUs"]),
    ],
)
def test_more_than_the_cluster_has_names_the_key(tiny_root, tmp_path, train, cluster, words):
    from prvrlab.platform.config import ConfigError, validate
    from prvrlab.platform.train.driver import check_resources

    with pytest.raises(ConfigError) as info:
        check_resources(validate(small_raw(tiny_root, tmp_path, **train)), cluster)
    assert all(w in str(info.value) for w in words), info.value
    check_resources(validate(small_raw(tiny_root, tmp_path, **train)), {"CPU": 64.0, "GPU": 8.0})


def test_no_ray_gpu_without_cuda_fails_fast(tiny_root, tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    raw = small_raw(tiny_root, tmp_path)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    assert main(["train", str(cfg), "--no-ray", "--set", "train.use_gpu=true"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "train.use_gpu is true but this machine sees no CUDA device" in err, err
    assert recorded_runs(raw) == []
