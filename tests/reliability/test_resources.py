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
