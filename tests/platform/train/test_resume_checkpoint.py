"""What a resumed attempt continues from its checkpoint: the early stop (a run that had stopped does not
train again) and, under fp16, the gradient scaler's loss scale and growth count."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from prvrlab.platform.config import validate
from prvrlab.platform.train.loop import TrainingLoop
from prvrlab.platform.train.session import LocalSession

from train_helpers import small_raw


class Crash(Exception):
    """A worker's death, as the driver's retry sees it."""


def stops_by_hand(sumrs: list[float], patience: int) -> bool:
    """Whether ``early_stop: at_patience`` stops after the last of these epochs' validation SumRs: the last
    ``patience`` epochs brought none better than the best before them."""
    best, bad = -1.0, 0
    for sumr in sumrs:
        best, bad = (sumr, 0) if sumr > best else (best, bad + 1)
    return bad >= patience


class CrashingSession(LocalSession):
    """A local session whose worker dies once: in the final report (``crash="final"``) or just after the
    report (and checkpoint) of the epoch the early-stopping rule stops at (``crash="epoch"``)."""

    def __init__(self, root: Path, *, crash: str | None, patience: int = 0) -> None:
        super().__init__(root)
        self.crash, self.patience = crash, patience

    def report(self, metrics, checkpoint_dir=None):
        if metrics.get("kind") == "final" and self.crash == "final":
            raise Crash("worker died during the final evaluation")
        super().report(metrics, checkpoint_dir)
        sumrs = [r["val/sumr"] for r in self.reports if r["kind"] == "epoch"]
        if metrics.get("kind") == "epoch" and self.crash == "epoch" and stops_by_hand(sumrs, self.patience):
            raise Crash("worker died just after the report of the epoch the run stops at")


@pytest.mark.parametrize("crash", ["final", "epoch"])
def test_a_run_resumed_after_its_early_stop_only_runs_the_final_round(tiny_root, tmp_path, crash):
    epochs, patience = 8, 1
    # lr 1e-12: the weights do not move, so no epoch after the first improves the validation SumR
    cfg = validate(small_raw(tiny_root, tmp_path, epochs=epochs, lr=1e-12, early_stop="at_patience",
                             early_stop_patience=patience))
    first = CrashingSession(tmp_path / "session", crash=crash, patience=patience)
    with pytest.raises(Crash):
        TrainingLoop(cfg, session=first, run_dir=tmp_path / "run").run()
    sumrs = [r["val/sumr"] for r in first.reports if r["kind"] == "epoch"]
    stop = len(sumrs)
    assert stop < epochs and stops_by_hand(sumrs, patience)  # it stopped early, at the rule's epoch
    assert not any(stops_by_hand(sumrs[:n], patience) for n in range(1, stop))

    resumed = CrashingSession(tmp_path / "session", crash=None)
    loop = TrainingLoop(cfg, session=resumed, run_dir=tmp_path / "run")
    loop.run()
    assert [r["kind"] for r in resumed.reports] == ["final"]  # no epoch trained after the stop
    final = resumed.reports[0]
    best = max(range(stop), key=lambda i: (sumrs[i], -i))  # the first epoch with the highest SumR
    assert final["best/epoch"] == best + 1 and final["best/sumr"] == sumrs[best]
    assert final["val/sumr"] == pytest.approx(sumrs[best])  # the best model, evaluated again
    assert loop.progress.epoch == stop - 1 and loop.progress.bad_epochs == patience


class StopAfter(Exception):
    pass


class ScalerSession(LocalSession):
    """Records the live loop's scaler state at each epoch's report; raises after ``stop_after``'s."""

    def __init__(self, root: Path, *, stop_after: int | None) -> None:
        super().__init__(root)
        self.stop_after = stop_after
        self.loop: TrainingLoop | None = None
        self.scaler_states: list[dict] = []

    def report(self, metrics, checkpoint_dir=None):
        super().report(metrics, checkpoint_dir)
        if metrics.get("kind") == "epoch":
            self.scaler_states.append(self.loop.scaler.state_dict())
            if metrics["epoch"] == self.stop_after:
                raise StopAfter()


def _fp16_config(tiny_root: Path, tmp_path: Path):
    cfg = validate(small_raw(tiny_root, tmp_path, epochs=3))
    cfg.train.amp = "fp16"  # as on a GPU (validation refuses fp16 without one); the CPU's GradScaler acts the same
    return cfg


def _loop(cfg, session: ScalerSession, run_dir: Path) -> TrainingLoop:
    session.loop = TrainingLoop(cfg, session=session, run_dir=run_dir)
    return session.loop


@pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::UserWarning")
def test_the_fp16_gradient_scaler_resumes_with_its_scale_and_growth_count(tiny_root, tmp_path):
    cfg = _fp16_config(tiny_root, tmp_path)
    first = ScalerSession(tmp_path / "session", stop_after=1)
    with pytest.raises(StopAfter):
        _loop(cfg, first, tmp_path / "run").run()
    at_checkpoint = first.scaler_states[0]
    fresh = torch.amp.GradScaler("cpu").state_dict()
    assert at_checkpoint["_growth_tracker"] > 0 or at_checkpoint["scale"] != fresh["scale"]  # not a fresh scaler's
    saved = torch.load(tmp_path / "session" / "checkpoint_latest" / "state.pt", weights_only=True)
    assert saved["scaler"] == at_checkpoint

    resumed = _loop(cfg, ScalerSession(tmp_path / "session", stop_after=None), tmp_path / "run")
    resumed.setup()
    assert resumed.scaler.state_dict() == fresh
    resumed.restore()
    assert resumed.scaler.state_dict() == at_checkpoint


@pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::UserWarning")
def test_a_checkpoint_without_scaler_state_resumes_with_a_fresh_scaler(tiny_root, tmp_path):
    cfg = _fp16_config(tiny_root, tmp_path)
    with pytest.raises(StopAfter):
        _loop(cfg, ScalerSession(tmp_path / "session", stop_after=1), tmp_path / "run").run()
    path = tmp_path / "session" / "checkpoint_latest" / "state.pt"
    old = torch.load(path, weights_only=True)
    del old["scaler"]  # what checkpoints held before the scaler's state was saved
    torch.save(old, path)
    resumed = _loop(cfg, ScalerSession(tmp_path / "session", stop_after=None), tmp_path / "run")
    resumed.setup()
    resumed.restore()
    assert resumed.scaler.state_dict() == torch.amp.GradScaler("cpu").state_dict()
    assert resumed.progress.epoch == 0 and resumed.global_step == old["global_step"]


def test_without_fp16_a_checkpoint_holds_no_scaler_state(tiny_root, tmp_path):
    cfg = validate(small_raw(tiny_root, tmp_path, epochs=2))
    with pytest.raises(StopAfter):
        _loop(cfg, ScalerSession(tmp_path / "session", stop_after=1), tmp_path / "run").run()
    saved = torch.load(tmp_path / "session" / "checkpoint_latest" / "state.pt", weights_only=True)
    assert "scaler" not in saved
