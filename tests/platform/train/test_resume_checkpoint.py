"""What a resumed attempt continues from its checkpoint: the early stop (a run that had stopped does not
train again), under fp16 the gradient scaler's loss scale and growth count, and every rank's own random
stream (a two-rank run with dropout resumes as it would have gone on)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from prvrlab.platform.config import validate
from prvrlab.platform.train.loop import RANK_STATES, TrainingLoop, rank_random_state, rank_seed
from prvrlab.platform.train.session import LocalSession

from train_helpers import gloo_group, small_raw


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


# ------------------------------------------------------------ every rank's random state

class SharedCheckpointSession(LocalSession):
    """Rank ``rank`` of ``world``: resumes from rank 0's checkpoint (as Ray Train hands every rank the one that
    rank 0 reported); ``stop_after``: every rank stops after that epoch's report (an interrupted attempt).
    Records this rank's CPU random state at each epoch's report (a digest)."""

    def __init__(self, base: Path, *, rank: int, world: int, stop_after: int | None) -> None:
        super().__init__(base / f"session{rank}")
        self.rank, self.world_size = rank, world
        self.base, self.stop_after = base, stop_after
        self.streams: list[str] = []

    def checkpoint_dir(self):
        return LocalSession(self.base / "session0").checkpoint_dir()

    def report(self, metrics, checkpoint_dir=None):
        super().report(metrics, checkpoint_dir)
        if metrics.get("kind") == "epoch":
            self.streams.append(hashlib.sha1(torch.get_rng_state().numpy().tobytes()).hexdigest())
            if metrics["epoch"] == self.stop_after:
                raise StopAfter()


def _train_rank(cfg, base: Path, *, rank: int, world: int, stop_after: int | None) -> dict:
    """This rank's ``train/loss`` of every epoch it trained (the mean over ranks) and its random states."""
    session = SharedCheckpointSession(base, rank=rank, world=world, stop_after=stop_after)
    try:
        TrainingLoop(cfg, session=session, run_dir=base / "run").run()
    except StopAfter:
        pass
    return {"loss": [r["train/loss"] for r in session.reports if r["kind"] == "epoch"], "streams": session.streams}


def _resume_rank(rank: int, world: int, init_file: str, raw: dict, out_dir: str) -> None:
    """One rank of an uninterrupted run and of a run interrupted after epoch 1 and resumed (one process group)."""
    out = Path(out_dir)
    cfg = validate(raw)
    with gloo_group(rank, world, init_file):
        got = {
            "full": _train_rank(cfg, out / "full", rank=rank, world=world, stop_after=None),
            "cut": _train_rank(cfg, out / "cut", rank=rank, world=world, stop_after=1),
        }
        dist.barrier()  # rank 0 has written the cut run's checkpoint before any rank resumes from it (as Ray Train
        # hands the ranks a checkpoint only once reported); without it rank 1 could start afresh and the ranks part
        got["resumed"] = _train_rank(cfg, out / "cut", rank=rank, world=world, stop_after=None)
    (out / f"rank{rank}.json").write_text(json.dumps(got))


def test_a_resumed_two_rank_run_continues_every_ranks_random_stream(tiny_root, tmp_path):
    """Dropout draws on each rank and the ranks' streams part during an epoch, so the checkpoint holds every
    rank's state and each rank resumes its own: the resumed run trains as the uninterrupted one (before,
    every rank resumed rank 0's stream, and the second epoch's loss and the weights differed)."""
    raw = small_raw(tiny_root, tmp_path, epochs=2, batch_size=8, torch_threads=1)
    raw["model"]["dropout"] = 0.2
    raw["eval"]["final_splits"] = ["val"]
    mp.spawn(_resume_rank, args=(2, str(tmp_path / "init"), raw, str(tmp_path)), nprocs=2, join=True)
    zero, one = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    for run in ("full", "cut", "resumed"):
        assert zero[run]["loss"] == one[run]["loss"]  # the epoch means are over both ranks
    full, cut, resumed = zero["full"]["loss"], zero["cut"]["loss"], zero["resumed"]["loss"]
    assert len(full) == 2 and len(cut) == 1 and len(resumed) == 1
    assert cut == pytest.approx(full[:1], rel=1e-6, abs=0)
    assert resumed == pytest.approx(full[1:], rel=1e-6, abs=0)
    assert zero["full"]["streams"][0] != one["full"]["streams"][0]  # the ranks' streams parted in epoch 1
    for got in (zero, one):
        assert got["cut"]["streams"] == got["full"]["streams"][:1]
        assert got["resumed"]["streams"] == got["full"]["streams"][1:]  # each rank went on with its own stream

    full_ckpt, cut_ckpt = (torch.load(tmp_path / run / "session0" / "checkpoint_latest" / "state.pt", weights_only=True)
                           for run in ("full", "cut"))
    assert len(full_ckpt[RANK_STATES]) == 2
    assert torch.equal(full_ckpt["rng"], full_ckpt[RANK_STATES][0]["rng"])  # rank 0's, where an older prvrlab reads it
    assert full_ckpt["model"].keys() == cut_ckpt["model"].keys()
    for name, weight in full_ckpt["model"].items():  # the last epoch's weights
        torch.testing.assert_close(cut_ckpt["model"][name], weight, rtol=1e-6, atol=1e-7, msg=name)


def test_a_checkpoint_with_one_random_state_gives_it_to_every_rank(tiny_root, tmp_path):
    """A checkpoint written before per-rank states (rank 0's ``rng`` only) still resumes: rank 0 restores that
    state, as before; another rank (or a rank beyond the saved ones, in a resume with more ranks) gets rank 0's
    and then reseeds from ``train.seed`` and the step, so no two ranks draw the same dropout masks."""
    cfg = validate(small_raw(tiny_root, tmp_path, epochs=2))
    with pytest.raises(StopAfter):
        _loop(cfg, ScalerSession(tmp_path / "session", stop_after=1), tmp_path / "run").run()
    path = tmp_path / "session" / "checkpoint_latest" / "state.pt"
    new = torch.load(path, weights_only=True)
    assert len(new[RANK_STATES]) == 1 and torch.equal(new[RANK_STATES][0]["rng"], new["rng"])
    old = {k: v for k, v in new.items() if k != RANK_STATES}  # what checkpoints held before
    torch.save(old, path)
    for rank in (0, 1):
        session = ScalerSession(tmp_path / "session", stop_after=None)
        session.rank, session.world_size = rank, 2  # setup and restore join no collective
        loop = _loop(cfg, session, tmp_path / "run")
        loop.setup()
        torch.manual_seed(123)  # a stream the restore must replace
        loop.restore()
        if rank == 0:
            assert torch.equal(torch.get_rng_state(), old["rng"])
        else:
            restored = torch.get_rng_state()
            torch.manual_seed(rank_seed(cfg.train.seed + old["global_step"], rank))
            assert torch.equal(restored, torch.get_rng_state()) and not torch.equal(restored, old["rng"])
        assert loop.progress.epoch == 0 and loop.global_step == old["global_step"]

    zero, one = torch.tensor([0], dtype=torch.uint8), torch.tensor([1], dtype=torch.uint8)
    saved = {"rng": zero, RANK_STATES: [{"rng": zero}, {"rng": one}]}
    assert [rank_random_state(saved, r)["rng"].item() for r in range(3)] == [0, 1, 0]  # three ranks, two saved
    assert rank_random_state({"rng": one}, 1)["rng"].item() == 1  # the old single state, on any rank
