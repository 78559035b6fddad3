"""End-to-end training: in-process worker, Ray Train DDP, resume, NaN, MLflow."""

from __future__ import annotations

import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from prvrlab.data.batch import Batch
from prvrlab.losses.base import Loss
from prvrlab.models.base import ModelOutput
from prvrlab.platform.config import validate
from prvrlab.platform.failures import ERROR_FILE
from prvrlab.platform.train import driver
from prvrlab.platform.train.checkpoint_eval import checkpoint_epoch
from prvrlab.platform.train.driver import TrainingError, train
from prvrlab.platform.train.loop import CHECKPOINT_FORMAT
from prvrlab.platform.tracking.store import Tracker
from prvrlab.registry import LOSSES

from train_helpers import small_raw, untrained_val_sumr


def runs(raw: dict):
    tracker = Tracker(raw["tracking"]["uri"], raw["tracking"]["experiment"])
    return tracker.client.search_runs([tracker.experiment_id])


def test_a_stop_that_other_code_wrapped_still_ends_the_run_killed(tiny_root, tmp_path, monkeypatch):
    """SIGTERM (Ctrl-C) can land inside a lazy import, where Python 3.11 wraps the interrupt in
    ``RuntimeError: Error calling __set_name__``: the run is KILLED, the interrupt goes on, no error.txt."""
    from prvrlab.platform.train import loop

    class StopsWhenNamed:
        def __set_name__(self, owner, name):
            raise KeyboardInterrupt

    def interrupted_worker(*args, **kwargs):
        type("LiteralExpr", (), {"data_type": StopsWhenNamed()})

    monkeypatch.setattr(loop, "run_local", interrupted_worker)
    raw = small_raw(tiny_root, tmp_path)
    with pytest.raises(KeyboardInterrupt):
        train(validate(raw), use_ray=False, echo=None)
    (run,) = runs(raw)
    assert run.info.status == "KILLED" and "error" not in run.data.tags
    assert not list(tmp_path.rglob(ERROR_FILE))


def test_in_process_training_learns_and_is_recorded(tiny_root, tmp_path):
    raw = small_raw(tiny_root, tmp_path)
    before = untrained_val_sumr(raw)
    lines: list[str] = []
    result = train(validate(raw), use_ray=False, echo=lines.append)
    assert result.best_sumr > before + 20, (before, result.best_sumr)
    (run,) = runs(raw)
    assert run.info.status == "FINISHED"
    assert run.data.params["train.lr"] == "0.001"
    assert run.data.tags["backbone"] == "gmmformer"
    assert run.data.metrics["best/sumr"] == pytest.approx(result.best_sumr)
    assert "train/clip_triplet" in run.data.metrics and "val/r100" in run.data.metrics
    ranks = pq.read_table(result.run_dir / "ranks_test.parquet")
    assert set(ranks.column_names) >= {"query_id", "video_id", "rank"}
    assert_epochs_count_from_one(result, run, lines, raw)


def assert_epochs_count_from_one(result, run, lines: list[str], raw: dict) -> None:
    """Console, MLflow steps and best/epoch, and the model file all count epochs from 1."""
    n, epochs = len(result.history), raw["train"]["epochs"]  # n < epochs after an early stop
    assert [h["epoch"] for h in result.history] == list(range(1, n + 1))
    sumrs = [h["val/sumr"] for h in result.history]
    best = 1 + max(range(n), key=lambda i: (sumrs[i], -i))  # the first epoch reaching the best value
    assert result.best_epoch == best and run.data.metrics["best/epoch"] == best
    epoch_lines = [ln for ln in lines if ln.startswith("epoch ")]
    assert [int(re.match(rf"epoch +(\d+)/{epochs} ", ln).group(1)) for ln in epoch_lines] == list(range(1, n + 1))
    assert re.search(r"best [\d.]+@(\d+)", epoch_lines[-1]).group(1) == str(best)
    client = Tracker(raw["tracking"]["uri"], raw["tracking"]["experiment"]).client
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val/sumr")] == list(range(1, n + 1))
    for key in ("best/sumr", "best/epoch"):  # the final round's point sits at the best epoch, not at step 0
        steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, key))
        assert steps == sorted([*range(1, n + 1), best]), (key, steps)
    assert run.data.tags["prvrlab.epoch_base"] == "1"
    blob = torch.load(result.run_dir / "best_model.pt", map_location="cpu", weights_only=True)
    assert blob["format"] == CHECKPOINT_FORMAT == 8 and blob["epoch"] == best == checkpoint_epoch(blob)


@LOSSES.register("test_nan")
class NanLoss(Loss):
    """Becomes NaN on the second epoch (test only)."""

    def __init__(self) -> None:
        super().__init__()

    def forward(self, out: ModelOutput, batch: Batch, *, epoch: int) -> torch.Tensor:
        value = out.scores["clip"].sim.mean()
        return value * float("nan") if epoch >= 1 else value * 0.0


def test_nan_loss_fails_the_run_cleanly(tiny_root, tmp_path):
    raw = small_raw(tiny_root, tmp_path, epochs=3)
    raw["losses"]["bad_term"] = {"loss": "test_nan", "weight": 1.0}
    with pytest.raises(TrainingError, match=r"^non-finite loss at epoch 2: term\(s\) bad_term "):  # epochs from 1
        train(validate(raw), use_ray=False, echo=None)
    (run,) = runs(raw)
    assert run.info.status == "FAILED"
    assert "bad_term" in run.data.tags["error"]


@pytest.mark.slow
def test_two_worker_ddp_through_ray_train(tiny_root, tmp_path):
    raw = small_raw(tiny_root, tmp_path, num_workers=2, epochs=6)
    before = untrained_val_sumr(raw)
    result = train(validate(raw), echo=None)
    assert result.best_sumr > before + 20, (before, result.best_sumr)
    (run,) = runs(raw)
    assert run.info.status == "FINISHED"
    artifacts = {a.path for a in Tracker(raw["tracking"]["uri"], "tests").client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "ranks", "checkpoints"} <= artifacts
    assert (result.run_dir / "best_model.pt").is_file()


@pytest.mark.slow
def test_worker_failure_resumes_from_last_checkpoint(tiny_root, tmp_path, monkeypatch):
    marker = tmp_path / "crashed"
    monkeypatch.setenv("PRVRLAB_FAULT_EPOCH", "1")
    monkeypatch.setenv("PRVRLAB_FAULT_MARKER", str(marker))
    raw = small_raw(tiny_root, tmp_path, num_workers=2, epochs=4, max_failures=1)
    lines: list[str] = []
    result = train(validate(raw), echo=lines.append)
    assert marker.exists(), "the injected crash did not happen"
    epochs = [h["epoch"] for h in result.history]
    assert epochs.count(1) == 1 and epochs[-1] == 4, epochs  # resumed, not started over
    assert epochs == [1, 2, 3, 4], epochs  # resumed right after the last checkpoint (epoch 2; the hook counts from 0)
    (run,) = runs(raw)
    assert run.info.status == "FINISHED"
    # said plainly on the console and on the run; Ray's full text kept as the error.txt artifact
    retry = next(line for line in lines if line.startswith("worker died: worker rank 0"))
    assert "retrying from the last checkpoint (1 of train.max_failures=1)" in retry
    assert run.data.tags["prvrlab.retries"] == "1"
    assert run.data.tags["prvrlab.last_failure"] == retry.splitlines()[0]
    error_txt = Path(Tracker(raw["tracking"]["uri"], "tests").client.download_artifacts(run.info.run_id, ERROR_FILE, str(tmp_path)))
    text = error_txt.read_text()
    assert text.startswith("=== attempt 1: worker died") and "WorkerGroupError" in text and "exit type" in text.lower()


@pytest.mark.slow
def test_error_in_the_training_code_under_ray_is_not_retried(tiny_root, tmp_path, monkeypatch):
    marker = tmp_path / "raised"
    monkeypatch.setenv("PRVRLAB_FAULT_EPOCH", "0")
    monkeypatch.setenv("PRVRLAB_FAULT_MARKER", str(marker))
    monkeypatch.setenv("PRVRLAB_FAULT_KIND", "raise")  # raises once: a retry would finish the run
    raw = small_raw(tiny_root, tmp_path, epochs=2, max_failures=2)
    with pytest.raises(TrainingError) as info:
        train(validate(raw), echo=None)
    assert str(info.value) == "error in the training code (worker rank 0): RuntimeError: injected fault after epoch 0"
    (run,) = runs(raw)
    assert run.info.status == "FAILED" and run.data.tags["error"] == str(info.value)
    assert "prvrlab.retries" not in run.data.tags
    error_txt = Path(Tracker(raw["tracking"]["uri"], "tests").client.download_artifacts(run.info.run_id, ERROR_FILE, str(tmp_path)))
    assert error_txt.read_text().count("=== attempt ") == 1 and "Traceback" in error_txt.read_text()


def _oom() -> Exception:
    from ray.exceptions import OutOfMemoryError

    return OutOfMemoryError((Path(__file__).parent / "ray_messages" / "oom_memory_monitor.txt").read_text())


def test_the_driver_retries_a_retryable_failure_up_to_max_failures(tiny_root, tmp_path, monkeypatch):
    raw = small_raw(tiny_root, tmp_path, max_failures=2)
    calls: list[int] = []

    def always_oom(*args):
        calls.append(1)
        raise _oom()

    monkeypatch.setattr(driver, "_fit_once", always_oom)
    retries: list[tuple[str, int]] = []
    run_dir = tmp_path / "files"
    with pytest.raises(TrainingError, match=r"^2 training workers, Ray Train's controller and 3 Ray helpers killed: out of memory, 2.4 of 23.5 GiB in use; lower train.batch_size"):
        driver.fit_with_ray(validate(raw), run_dir, "r", lambda m: None, lambda f, n: retries.append((f.kind, n)))
    assert len(calls) == 3  # the first attempt + train.max_failures retries
    assert retries == [("out_of_memory", 1), ("out_of_memory", 2)]
    assert (run_dir / ERROR_FILE).read_text().count("=== attempt ") == 3


def test_the_driver_resumes_after_a_retryable_failure_and_stops_at_a_code_error(tiny_root, tmp_path, monkeypatch):
    raw = small_raw(tiny_root, tmp_path, max_failures=2)
    outcomes = iter([_oom(), None])

    def flaky(*args):
        error = next(outcomes)
        if error is not None:
            raise error

    monkeypatch.setattr(driver, "_fit_once", flaky)
    driver.fit_with_ray(validate(raw), tmp_path / "a", "r", lambda m: None)
    assert next(outcomes, "done") == "done"  # fitted twice, then returned

    calls: list[int] = []

    def buggy(*args):
        calls.append(1)
        raise ValueError("shapes (4, 8) and (9, 8) do not match")

    monkeypatch.setattr(driver, "_fit_once", buggy)
    with pytest.raises(TrainingError, match="^error in the training code: ValueError: shapes"):
        driver.fit_with_ray(validate(raw), tmp_path / "b", "r", lambda m: None)
    assert calls == [1]


def test_in_process_training_with_the_ral_plugin_logs_sigma(tiny_root, tmp_path):
    raw = small_raw(tiny_root, tmp_path, epochs=2)
    raw["plugins"] = {"ral": {"num_proxies": 2}}
    raw["losses"]["ral_da"] = {"loss": "ral_da", "weight": 2.5e-4}
    raw["losses"]["ral_pm"] = {"loss": "ral_pm", "weight": 4e-3, "tau": 0.07}
    result = train(validate(raw), use_ray=False, echo=None)
    assert len(result.history) == 2
    (run,) = runs(raw)
    assert run.info.status == "FINISHED"
    assert run.data.tags["plugins"] == "ral.msra,ral.csa"
    for key in ("train/ral.sigma_query", "train/ral.sigma_video", "train/ral_da", "train/ral_pm"):
        assert key in run.data.metrics, key
    assert run.data.metrics["train/ral.sigma_video"] > 0
