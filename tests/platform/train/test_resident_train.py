"""Training on a resident split (``data.resident``) is training on the streamed one, to the bit; resumed runs with
loader workers go on as the uninterrupted run."""

from __future__ import annotations

import pytest
import torch

from prvrlab.platform.config import validate
from prvrlab.platform.train.loop import run_local, train_worker
from prvrlab.platform.train.session import LocalSession

from device_under_test import DEVICE, as_a_program
from train_helpers import small_raw


def _config(root, tmp, resident: bool):
    raw = small_raw(root, tmp, epochs=3, use_gpu=DEVICE.type == "cuda")  # PRVRLAB_TEST_DEVICE=cuda: held on the GPU
    raw["model"]["dropout"] = 0.2  # the random stream matters: dropout draws from it every step
    raw["data"].update({"resident": resident, "loader_workers": 1})
    return validate(raw)


def assert_same_reports(got: list[dict], want: list[dict]) -> None:
    """Equal to the bit on the CPU; on a GPU to 1e-5 (its atomic-add kernels may sum in another order run to run)."""
    if DEVICE.type == "cpu":
        assert got == want
        return
    assert [sorted(r) for r in got] == [sorted(r) for r in want]
    for g, w in zip(got, want, strict=True):
        for key, value in w.items():
            same = g[key] == pytest.approx(value, rel=1e-5, abs=1e-6) if isinstance(value, float) else g[key] == value
            assert same, (key, g[key], value)


def _reports(root, tmp, resident: bool) -> list[dict]:
    with as_a_program():
        session = run_local(_config(root, tmp, resident), tmp / "run")
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in session.reports if r.get("kind") in ("epoch", "final")]


def test_a_resident_split_trains_as_the_streamed_one(tiny_root, tmp_path):
    torch.manual_seed(123)  # run_local seeds from the config: what came before must not matter
    streamed = _reports(tiny_root, tmp_path / "streamed", resident=False)
    torch.manual_seed(456)
    resident = _reports(tiny_root, tmp_path / "resident", resident=True)
    assert [r["kind"] for r in resident] == ["epoch"] * 3 + ["final"]
    assert streamed[0]["train/loss"] > streamed[2]["train/loss"]  # it learns
    assert_same_reports(resident, streamed)



@pytest.mark.parametrize("resident", [False, True])
def test_a_run_resumed_with_loader_workers_goes_on_as_the_uninterrupted_one(tiny_root, tmp_path, resident):
    """The loader's persistent workers drew a seed from the global stream at their start only, so a resumed
    attempt (fresh workers) drew once more than the uninterrupted run; they no longer draw from it at all."""
    whole = _reports(tiny_root, tmp_path / "whole", resident=resident)
    cfg = _config(tiny_root, tmp_path / "cut", resident)
    run_dir = tmp_path / "cut" / "run"
    fault = {"epoch": 0, "marker": str(tmp_path / "crashed"), "kind": "raise"}  # after epoch 1's checkpoint
    with as_a_program(), pytest.raises(RuntimeError, match="injected fault after epoch 0"):
        train_worker({"experiment": cfg, "run_dir": str(run_dir), "fault": fault}, LocalSession(run_dir / "local_session"))
    resumed = _reports(tiny_root, tmp_path / "cut", resident=resident)  # the same run folder: restores epoch 1
    assert [r.get("epoch") for r in resumed] == [2, 3, None]
    assert_same_reports(resumed, whole[1:])


def test_splits_that_do_not_fit_fail_the_run_with_one_message_naming_the_key(tiny_root, tmp_path, monkeypatch):
    pytest.importorskip("mlflow")  # the failed run is recorded
    from prvrlab.data import resident as resident_module
    from prvrlab.platform.tracking.store import Tracker
    from prvrlab.platform.train.driver import TrainingError, train

    monkeypatch.setattr(resident_module, "_HELD", {})
    monkeypatch.setattr(resident_module, "available_bytes", lambda device: 1 << 20)  # 1 MiB free
    raw = small_raw(tiny_root, tmp_path)
    raw["data"]["resident"] = True
    refused = r"data\.resident: the 'train' split's preprocessed features need [0-9.]+ MiB on cpu, and 1.0 MiB is free"
    with pytest.raises(TrainingError, match=refused):
        train(validate(raw), use_ray=False, echo=None)
    tracker = Tracker(raw["tracking"]["uri"], raw["tracking"]["experiment"])
    (run,) = tracker.client.search_runs([tracker.experiment_id])
    assert run.info.status == "FAILED" and "data.resident" in run.data.tags["error"]
