"""The training loop of one DDP rank (or of the whole run in-process), in named stages.

:class:`TrainingLoop` runs ``setup -> restore -> [epoch_start -> steps ->
epoch_end -> validate -> report] per epoch -> final_evaluation``.  Components
(losses and plug-ins, :mod:`prvrlab.models.component`) act through their
hooks at epoch start/end and after every step; the loop hands them what they
need (the model, a loader over this rank's training shard, the DDP group).
What trains is a :class:`~prvrlab.models.factory.TrainingSystem` (model + loss
terms): every parameter of every component is optimised, DDP-averaged and
checkpointed.

The loop only talks to a :class:`Session`, writes run files (best model,
per-query ranks) to the run folder and never touches MLflow: the driver is the
one process that writes to the tracking store.

Reported rounds (every rank reports the same number of times):
- one per epoch: ``kind="epoch"`` (``epoch`` and ``best/epoch`` count from 1, as users
  read "epoch 1 of 10"; the loop and the components' hooks count from 0) with train losses, component metrics
  (``train/<component>.<name>``), validation R@K/SumR, best-so-far, timings,
  and a checkpoint for failure recovery;
- one at the end: ``kind="final"`` with the best model's metrics on
  ``eval.final_splits`` and the run files written (the validation split's
  are the best epoch's own validation when this attempt ran it: the same
  weights, data and settings, so it is not encoded again), plus
  ``<split>/<metric>_vs_published`` (the run's minus the config's ``published`` result).
A non-finite loss ends training on every rank at the same step and is
reported as ``kind="nonfinite"`` (no retry: retrying cannot fix it).
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from prvrlab.files import replace_atomically, write_text_atomically
from prvrlab.platform.config import ExperimentConfig, spans_ranks, validate
from prvrlab.platform.train.session import LocalSession, RaySession, Session, scratch_dir
from prvrlab.uris import redact_nested

# best_model.pt layout: 2 = resolved config (every default written) + loss-term state;
# 3 = its "epoch" counts from 1 (as every report does; format 2 counted from 0);
# 4 = model.frame_training (MS-SL), plugins.ral.heads / csa_padding / word_encoder and data.normalize
# exist (older files: all_pairs, paper, masked, backbone, exact); 5 = plugins.ral.word_positions and
# heads_padding exist (older files: own, masked); 6 = plugins.ral.text_heads_padding exists (older files:
# masked; it acts in training only); 7 = plugins.ral.logvar_range, model.norm_decay (gmmformer_v2) and
# plugins.ral.norm_decay exist (older files: clamped, false, false; all act in training only); 8 = model.window:
# official divides each Gaussian window row by its maximum, as the reference (older files: official_raw).
CHECKPOINT_FORMAT = 8
FAULT_EPOCH_ENV = "PRVRLAB_FAULT_EPOCH"  # test hook: crash rank 0 once after this epoch
FAULT_MARKER_ENV = "PRVRLAB_FAULT_MARKER"  # file that records the crash already happened
FAULT_KIND_ENV = "PRVRLAB_FAULT_KIND"  # "exit" (the process dies, default) or "raise" (an error in the code)
NO_CUDA = "train.use_gpu is true but {who} sees no CUDA device"  # who: the worker, or the machine of a --no-ray run


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (model init identical on every rank)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def rank_seed(seed: int, rank: int) -> int:
    """The torch seed DDP rank ``rank`` draws its training randomness from after the model is built
    (dropout masks, a loss's random negatives): ``seed`` on rank 0, as one process; another stream on
    every other rank, so two ranks never draw the same masks for the rows of their equal-shaped shares."""
    return seed if rank == 0 else (seed * 1_000_003 + rank * 7_919) % (2**63)


def random_state(device: torch.device) -> dict[str, torch.Tensor]:
    """The generators a resumed run continues: the CPU's and, on a GPU, the device's (dropout draws there)."""
    state = {"rng": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda_rng"] = torch.cuda.get_rng_state(device)
    return state


def restore_random_state(saved: dict, device: torch.device) -> None:
    """Set what :func:`random_state` saved; generators take CPU byte tensors, wherever ``torch.load`` put them."""
    torch.set_rng_state(saved["rng"].cpu())
    if device.type == "cuda" and "cuda_rng" in saved:  # checkpoints before 2026-11-27 hold the CPU's only
        torch.cuda.set_rng_state(saved["cuda_rng"].cpu(), device)


RANK_STATES = "rank_random_states"  # a checkpoint's key: every rank's random_state(), in rank order


def rank_random_state(saved: dict, rank: int) -> dict:
    """The random state rank ``rank`` resumes from a checkpoint: its own (``saved[RANK_STATES][rank]``).

    The ranks' streams part after the first steps (their batches draw different numbers of numbers; dropout),
    so each rank saves its own.  A checkpoint written before per-rank states were saved holds rank 0's only
    (``rng``, ``cuda_rng``): every rank restores that, as then.  A resume with more ranks than wrote the
    checkpoint gives the ranks beyond them rank 0's state; with fewer, the extra states are not used.  A rank
    that got rank 0's state then reseeds (:meth:`TrainingLoop.restore`), so no two ranks draw alike.  With
    another rank count the run does not continue the old one exactly anyway: each rank's shard of the
    training data changes."""
    states = saved.get(RANK_STATES)
    if states and 0 <= rank < len(states):
        return states[rank]
    return saved


class Sealed:
    """A value DDP does not search for tensors (not a tensor, list, dict or dataclass)."""

    def __init__(self, value) -> None:
        self.value = value


class LossView(torch.nn.Module):
    """The training system as DDP wraps it: the forward's model output (embeddings, scores, aux)
    comes back :class:`Sealed`, so DDP's search for unused parameters starts from the loss alone; an
    embedding no loss reads (GMMFormer's pooled frame vector under RAL's CSA) then counts as unused."""

    def __init__(self, system: torch.nn.Module) -> None:
        super().__init__()
        self.system = system

    def forward(self, batch, *, epoch: int):
        result, out = self.system(batch, epoch=epoch)
        return result, Sealed(out)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """``tensor`` summed (``"sum"``) or maximised (``"max"``) over the DDP ranks (a new tensor)."""
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
    if op not in ops:
        raise ValueError(f"all_reduce op must be one of {', '.join(ops)}, got {op!r}")
    if not _distributed():
        return tensor
    out = tensor.clone()
    dist.all_reduce(out, op=ops[op])
    return out


def _broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not _distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather(obj: Any) -> list[Any] | None:
    """Every rank's ``obj`` in rank order on rank 0 (``[obj]`` with one rank), None on the others; a collective
    every rank joins."""
    if not _distributed():
        return [obj]
    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, gathered, dst=0)
    return gathered


def _union_of_names(names: list[str]) -> list[str]:
    """The sorted union of ``names`` over the ranks (so every rank reduces the same vector)."""
    if not _distributed():
        return sorted(names)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, names)
    return sorted(set().union(*gathered))


def pin_batches(device: torch.device, setting: bool | None) -> bool:
    """Whether the training loader page-locks its batches: only for a CUDA device, unless ``data.pin_memory`` is false."""
    return device.type == "cuda" and setting is not False


def _atomic_save(obj: Any, path: Path) -> None:
    replace_atomically(path, lambda tmp: torch.save(obj, tmp))


def _saved_best(path: Path) -> tuple[int, float] | None:
    """A saved best model's (0-based epoch, validation SumR); None when the file is missing, unreadable or written
    before the SumR was saved with it."""
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
        return int(blob["epoch"]) - 1, float(blob["val_sumr"])
    except Exception:  # noqa: BLE001 - missing, an older file, or cut short by the death of its writer
        return None


def fault_hook_from_env() -> dict[str, Any] | None:
    """The driver-side test hook: crash rank 0 once after an epoch (see FAULT_*_ENV)."""
    epoch, marker = os.environ.get(FAULT_EPOCH_ENV), os.environ.get(FAULT_MARKER_ENV)
    if epoch is None or marker is None:
        return None
    return {"epoch": int(epoch), "marker": marker, "kind": os.environ.get(FAULT_KIND_ENV, "exit")}


def _maybe_inject_fault(epoch: int, rank: int, hook: dict[str, Any] | None) -> None:
    """Kill this worker process (or raise, ``kind="raise"``) once after ``hook['epoch']`` on rank 0 (tests)."""
    if hook is None or rank != 0 or hook["epoch"] != epoch or Path(hook["marker"]).exists():
        return
    Path(hook["marker"]).write_text(f"crashed after epoch {epoch}\n")
    if hook.get("kind") == "raise":
        raise RuntimeError(f"injected fault after epoch {epoch}")
    time.sleep(hook.get("delay_s", 3.0))  # let the controller register the checkpoint
    os._exit(17)


@dataclass
class Progress:
    """What survives a restart besides the weights: the last finished epoch and early-stopping state."""

    epoch: int = -1
    best_sumr: float = -1.0
    best_epoch: int = -1
    bad_epochs: int = 0


class MetricSums:
    """Per-name sums and counts of per-step scalars, reduced over ranks at the epoch's end.

    A tensor value is summed where it lives, in float64 (the same sums as of its ``float()``s),
    so a step never waits for the device to report its scalars."""

    def __init__(self) -> None:
        self.sums: dict[str, float | torch.Tensor] = {}
        self.counts: dict[str, int] = {}

    def add(self, name: str, value: float | torch.Tensor) -> None:
        if isinstance(value, torch.Tensor):
            value = value.detach().reshape(()).double()
        self.sums[name] = self.sums.get(name, 0.0) + value
        self.counts[name] = self.counts.get(name, 0) + 1

    def mean_loss(self) -> float:
        """This rank's mean ``loss`` over the steps so far (reading it waits for the device)."""
        return float(self.sums.get("loss", math.nan)) / max(1, self.counts.get("loss", 0))

    def means(self) -> dict[str, float]:
        """Mean of every name over all steps of all ranks."""
        names = _union_of_names(list(self.sums))
        values = [float(self.sums.get(n, 0.0)) for n in names] + [float(self.counts.get(n, 0)) for n in names]
        totals = all_reduce(torch.tensor(values, dtype=torch.float64))
        k = len(names)
        return {n: float(totals[i] / max(1.0, float(totals[k + i]))) for i, n in enumerate(names)}


class TrainingLoop:
    """One rank's training run: build, restore, train epoch by epoch, evaluate the best model.

    ``cfg`` is the validated, fully resolved config (defaults filled in) that
    the driver checked; the loop does not validate it again.
    """

    def __init__(
        self,
        cfg: ExperimentConfig,
        *,
        session: Session,
        run_dir: str | Path,
        cpus_per_worker: float = 1.0,
        fault: dict[str, Any] | None = None,
        sync_to: str | None = None,
    ) -> None:
        from prvrlab.platform.storage import Mirror

        self.cfg = cfg
        self.session = session
        self.run_dir = Path(run_dir)
        self.mirror = Mirror(self.run_dir, sync_to)  # rank 0 pushes its files to an object store (no-op otherwise)
        self.cpus_per_worker = cpus_per_worker
        self.fault = fault
        self.rank, self.world = session.rank, session.world_size
        self.progress = Progress()
        self.global_step = 0
        self.step_lr: float | None = None  # the rate the latest optimiser step used (an epoch reports its last step's)
        self.ddp_unused: list[str] | None = None  # wrap(): the probe's unused parameters (None: not probed)
        self.setup_s: float | None = None  # setup + restore + DDP wrap, reported once per attempt as time/setup_s
        self.best_val: tuple[int, Any] | None = None  # (epoch, its validation EvalResult: rank 0, else None) of the best model

    # ------------------------------------------------------------ stages

    def setup(self) -> None:
        """Threads, device, seed, data, the training system, its DDP wrapper, the optimiser."""
        from prvrlab.allocator import cap_primitive_caches, set_host_allocator
        from prvrlab.data.dataset import train_loader
        from prvrlab.data.resident import hold_splits, release_held
        from prvrlab.evaluation.retrieval import resolve_amp_dtype
        from prvrlab.models.base import set_activation_checkpointing
        from prvrlab.models.factory import build_system
        from prvrlab.platform.train.optim import build_optimizer
        from prvrlab.vector_math import settle_vector_math

        cfg = self.cfg
        set_host_allocator(cfg.train.host_allocator)
        cap_primitive_caches()  # before the first product: batch shapes would otherwise pile up 1,024 of each
        settle_vector_math()  # before the first multi-threaded sqrt / exp / log: pytorch/pytorch#188792
        torch.set_num_threads(cfg.train.torch_threads or max(1, math.ceil(self.cpus_per_worker)))
        self.device = self._device()
        seed_everything(cfg.train.seed)
        self.collection = self.session.open_collection(cfg.data)
        self.truth = self.collection.truth(cfg.data.train_split)  # synthetic ground truth, else None
        dims = {"video_dim": self.collection.video_dim, "query_dim": self.collection.query_dim}
        global_batch = spans_ranks(cfg.train, self.world)  # the losses span every rank's share
        self.system = build_system(cfg.model, cfg.plugins, cfg.losses, **dims, global_batch=global_batch).to(self.device)
        if self.rank > 0:  # the same weights on every rank (above), then each rank's own draws
            torch.manual_seed(rank_seed(cfg.train.seed, self.rank))
        self.model = self.system.model
        # a model whose video encodings depend on their batch, or losses over the gathered global batch: every
        # rank pads its share to the global batch's longest video and query (the gathered batch is one process's)
        self.global_padding = (self.model.batch_dependent_videos() or global_batch) and self.world > 1
        set_activation_checkpointing(self.system, cfg.train.checkpoint_activations)
        self.components = self.system.components()
        self.per_rank = max(1, cfg.train.batch_size // self.world)
        self.resident = {}  # the training and validation splits held on the device (data.resident)
        if cfg.data.resident:
            self.resident = hold_splits(
                self.collection, [cfg.data.train_split, cfg.data.val_split], device=self.device,
                num_workers=cfg.data.loader_workers,
            )
        else:
            release_held()
        self.loader, self.sampler = train_loader(
            self.collection,
            cfg.data.train_split,
            batch_size_per_rank=self.per_rank,
            rank=self.rank,
            world_size=self.world,
            seed=cfg.train.seed,
            num_workers=cfg.data.loader_workers,
            pin_memory=pin_batches(self.device, cfg.data.pin_memory),
            resident=self.resident.get(cfg.data.train_split),
            global_padding=self.global_padding,
        )
        repeats = self.sampler.repeats_within_step()
        if repeats and global_batch and self.rank == 0:
            n = self.sampler.num_videos
            print(f"note: the {n} training videos are one short step of train.batch_size {cfg.train.batch_size}; to "
                  f"give {self.world} workers equal shares {repeats} of them are dealt twice in it, each also a "
                  f"negative of its own queries ({f'train.batch_size {n - n % self.world} or less' if n >= self.world else 'a number of workers that divides it'} avoids it)",
                  file=sys.stderr, flush=True)
        self.optimizer, self.scheduler = build_optimizer(
            self.system,
            lr=cfg.train.lr,
            weight_decay=cfg.train.weight_decay,
            total_steps=len(self.sampler) * cfg.train.epochs,
            warmup_proportion=cfg.train.warmup_proportion,
            warmup=cfg.train.warmup,
            max_grad_norm=cfg.train.grad_clip if cfg.train.clip_grad == "per_tensor" else 0.0,
        )
        self.amp_dtype = resolve_amp_dtype(cfg.train.amp)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.amp_dtype is torch.float16)
        self.best_path = self.run_dir / "best_model.pt"
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)

    def restore(self) -> None:
        """Resume from the session's latest checkpoint (weights, optimiser, schedule, fp16 gradient scaler, this
        rank's RNG (:func:`rank_random_state`), progress); a checkpoint without the scaler's state (written before
        it was saved) starts a fresh scaler.  Then the progress takes its best from ``best_model.pt``
        (:meth:`adopt_saved_best`)."""
        self.adopt_saved_best(restored=self._restore())

    def adopt_saved_best(self, *, restored: bool) -> None:
        """``best_model.pt`` is written when an epoch validates best, before that epoch's checkpoint is saved; an
        attempt that died in between (or whose checkpoint a session had not saved yet: Tune saves a reused pool's
        later) left a best the restored progress does not know, while the weights of the best it knows are
        gone.  The progress then takes the file's epoch and SumR, so the best reported is the one evaluated.
        Every rank joins (a broadcast of rank 0's progress), restored or not."""
        state = self.progress
        if self.rank == 0 and restored:
            saved = _saved_best(self.best_path)
            if saved is not None and saved != (state.best_epoch, state.best_sumr):
                print(f"best_model.pt holds epoch {saved[0] + 1} (val SumR {saved[1]:.2f}), not the checkpoint's best "
                      f"epoch {state.best_epoch + 1}: an earlier attempt wrote it after its last saved checkpoint; "
                      "it is the run's best now", file=sys.stderr, flush=True)
                state.best_epoch, state.best_sumr = saved
                state.bad_epochs = max(0, state.epoch - saved[0])  # epochs since it (none when it is later)
        self.progress = Progress(**_broadcast(asdict(state)))

    def _restore(self) -> bool:
        """:meth:`restore`'s loading; whether there was a checkpoint."""
        with self.session.checkpoint_dir() as ckpt:
            if ckpt is None:
                return False
            path = Path(ckpt) / "state.pt"
            saved = torch.load(path, map_location=self.device, weights_only=True)
            parts = [("model weights", self.model, "model"), ("optimiser state", self.optimizer, "optimizer"),
                     ("schedule", self.scheduler, "scheduler")]
            if "losses" in saved:
                parts.insert(1, ("loss-term state", self.system.losses, "losses"))
            if "scaler" in saved and self.scaler.is_enabled():
                parts.append(("fp16 gradient scaler state", self.scaler, "scaler"))
            for what, target, key in parts:
                try:
                    target.load_state_dict(saved[key])
                except (KeyError, RuntimeError, ValueError) as error:
                    first_line = (str(error).splitlines() or [repr(error)])[0]
                    raise RuntimeError(
                        f"cannot resume from {path}: loading its {what} failed ({type(error).__name__}: {first_line}); "
                        "it was written by another config or an older prvrlab: start a new run"
                    ) from error
            self.progress = Progress(**saved["progress"])
            self.global_step = int(saved.get("global_step", 0))
            restore_random_state(rank_random_state(saved, self.rank), self.device)
            saved_ranks = len(saved.get(RANK_STATES) or [])
            if self.rank >= saved_ranks > 0 or (self.rank > 0 and not saved_ranks):  # rank 0's state: draw apart
                torch.manual_seed(rank_seed(self.cfg.train.seed + self.global_step, self.rank))
            if self.rank == 0 and self.world > 1 and saved_ranks != self.world:
                wrote = f"{saved_ranks} rank(s)" if saved_ranks else "an older prvrlab (rank 0's random state only)"
                print(f"resuming {self.world} ranks from a checkpoint of {wrote}: the ranks without their own saved "
                      "random state draw from a seed derived from train.seed and the step", file=sys.stderr, flush=True)
        return True

    def wrap(self) -> torch.nn.Module:
        """The module the steps run: the system, in DDP when there are several ranks.

        A configuration can leave parameters out of every training step (a branch of weight 0, a
        fusion switched off, the GMMFormer frame pooling whose scores RAL's CSA replaces); DDP then
        has to look for them (``find_unused_parameters``) or it refuses the second step.  Whether
        to look is decided by a probe step (:mod:`prvrlab.platform.train.unused`; a probe that fails
        means look), agreed by all ranks; the unused parameters keep no gradient, as on one rank.
        DDP sees only the loss among the forward's outputs (:class:`LossView`), so its search starts
        where the backward does."""
        if self.world == 1:
            return self.system
        from prvrlab.platform.train.unused import probe_batch, unused_parameters

        try:
            data = self.cfg.data
            batch = probe_batch(video_dim=self.collection.video_dim, query_dim=self.collection.query_dim,
                                num_clips=data.num_clips, device=self.device, max_frames=data.max_frames,
                                max_query_len=data.max_query_len)
            unused: list[str] | None = unused_parameters(self.system, batch)
        except Exception:  # noqa: BLE001 - any failure of the probe: let DDP search every step
            unused = None
        search = bool(all_reduce(torch.tensor([0.0 if unused == [] else 1.0], device=self.device), "max").item())
        if search and self.rank == 0:
            what = "could not be probed" if unused is None else f"{len(unused)} unused: {', '.join(unused[:4])}"
            print(f"DDP looks for unused parameters every step (the parameters {what})", file=sys.stderr, flush=True)
        self.ddp_unused = unused
        kwargs = {"device_ids": [self.device.index]} if self.device.type == "cuda" else {}
        return torch.nn.parallel.DistributedDataParallel(LossView(self.system), find_unused_parameters=search, **kwargs)

    def epoch_context(self, epoch: int):
        """The :class:`EpochContext` handed to the components' epoch hooks."""
        from prvrlab.data.dataset import train_loader
        from prvrlab.models.component import EpochContext

        def train_batches():
            loader, _ = train_loader(
                self.collection,
                self.cfg.data.train_split,
                batch_size_per_rank=self.per_rank,
                rank=self.rank,
                world_size=self.world,
                shuffle=False,
                resident=self.resident.get(self.cfg.data.train_split),
                global_padding=self.global_padding,
            )
            for batch in loader:
                yield batch.to(self.device, non_blocking=True)

        return EpochContext(
            epoch=epoch,
            num_epochs=self.cfg.train.epochs,
            model=self.model,
            device=self.device,
            amp_dtype=self.amp_dtype,
            rank=self.rank,
            world_size=self.world,
            train_batches=train_batches,
            all_reduce=all_reduce,
            process_group=dist.group.WORLD if _distributed() else None,
            truth=self.truth,
        )

    def epoch_start(self, epoch: int) -> dict[str, float]:
        """Every component's ``on_epoch_start``; their metrics as ``train/<component>.<name>``."""
        return self._epoch_hooks(epoch, "on_epoch_start")

    def epoch_end(self, epoch: int) -> dict[str, float]:
        """Every component's ``on_epoch_end``; their metrics as ``train/<component>.<name>``."""
        return self._epoch_hooks(epoch, "on_epoch_end")

    def _epoch_hooks(self, epoch: int, hook: str) -> dict[str, float]:
        from prvrlab.models.component import Component

        out: dict[str, float] = {}
        ctx = None
        for prefix, component in self.components.items():
            if getattr(type(component), hook) is getattr(Component, hook):
                continue  # not overridden: no context built, no loader opened
            ctx = ctx or self.epoch_context(epoch)
            for name, value in (getattr(component, hook)(ctx) or {}).items():
                out[f"train/{prefix}.{name}"] = float(value)
            self.write_distributions(prefix, component, epoch)
        if ctx is not None:
            self.system.train()
        return out

    def write_distributions(self, prefix: str, component, epoch: int) -> None:
        """The distributions ``component`` logged in a hook, summed over the ranks, as
        ``<run_dir>/distributions/<prefix>.<name>.json`` (rank 0; uploaded by the driver)."""
        from prvrlab.models.component import DISTRIBUTIONS_DIR, histogram_record

        for name, (series, low, high, bins) in component.pop_distributions().items():
            record = histogram_record(series, low=low, high=high, bins=bins, all_reduce=all_reduce)
            if self.rank == 0:
                folder = self.run_dir / DISTRIBUTIONS_DIR
                folder.mkdir(parents=True, exist_ok=True)
                record = {"component": prefix, "name": name, "epoch": epoch + 1, **record}
                write_text_atomically(folder / f"{prefix}.{name}.json", json.dumps(record, indent=1))

    def step(self, train_model: torch.nn.Module, batch, epoch: int, step: int, sums: "MetricSums") -> str:
        """One optimiser step on every rank; returns a failure message ('' when the loss was finite).

        The host waits for the device once per step: after the backward pass, for the ranks'
        summed non-finite-loss flag, before any weight changes (a non-finite loss stops every
        rank at the same step with the weights of the step before).  Losses and logged metrics
        are summed on the device."""
        from prvrlab.losses.weighted import NonFiniteLossError
        from prvrlab.models.component import StepContext

        batch = batch.to(self.device, non_blocking=True)
        dtype = self.amp_dtype
        with torch.autocast(self.device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            result, out = train_model(batch, epoch=epoch)
        if isinstance(out, Sealed):
            out = out.value
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(result.total).backward()
        if all_reduce(result.non_finite()).item() > 0:  # every rank stops at the same step
            try:
                result.check_finite(epoch)
            except NonFiniteLossError as exc:
                return str(exc)
            return f"non-finite loss at epoch {epoch + 1} on another worker"
        if self.cfg.train.grad_clip > 0 and self.cfg.train.clip_grad == "global":  # per_tensor: in optimizer.step
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.system.parameters(), self.cfg.train.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.step_lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        sums.add("loss", result.total)
        for term, value in result.terms.items():
            sums.add(term, value)
        ctx = StepContext(
            epoch=epoch,
            step=step,
            global_step=self.global_step,
            batch=out.batch,  # the batch the output spans (the global one under a global batch)
            ranks=self.world if self.system.global_batch else 1,
            output=out,
            terms=result.terms,
            truth=self.truth,
        )
        for prefix, component in self.components.items():
            component.on_step_end(ctx)
            for name, value in component.pop_step_metrics().items():
                sums.add(f"{prefix}.{name}", value)
        self.global_step += 1
        return ""

    def train_epoch(self, epoch: int, train_model: torch.nn.Module) -> tuple[dict[str, float], str]:
        """All steps of one epoch; (mean train metrics over steps and ranks, failure message or '')."""
        self.sampler.set_epoch(epoch)
        train_model.train()
        sums = MetricSums()
        ticker = self._ticker(epoch)
        for step, batch in enumerate(self.loader):
            failure = self.step(train_model, batch, epoch, step, sums)
            if failure:
                return {}, failure
            if ticker is not None:
                ticker.step(sums.mean_loss)  # read at most every few tenths of a second
        return {f"train/{name}": value for name, value in sums.means().items()}, ""

    def _ticker(self, epoch: int):
        """Rank 0's in-epoch progress (batches, running loss, rate, ETA) to the session's sink; None elsewhere."""
        from prvrlab.platform.train.live import EpochTicker

        if self.rank != 0:
            return None
        emit = self.session.progress_sink(self.run_dir)
        return EpochTicker(epoch=epoch + 1, epochs=self.cfg.train.epochs, total=len(self.loader), emit=emit)  # from 1, as reports

    def validate(self, epoch: int) -> dict[str, float]:
        """Every rank encodes its share of the validation split; rank 0 scores, keeps the best model; state is shared."""
        from prvrlab.evaluation.retrieval import evaluate

        metrics: dict[str, float] = {}
        state = self.progress
        previous_best = state.best_epoch  # an adopted best (adopt_saved_best) may be this epoch of a dead attempt
        result = evaluate(
            self.model, self.collection, self.cfg.data.val_split, self.cfg.eval, device=self.device,
            amp_dtype=self.amp_dtype, rank=self.rank, world_size=self.world,
            resident=self.resident.get(self.cfg.data.val_split),
        )
        if self.rank == 0:
            metrics = {f"val/{k}": v for k, v in result.metrics.items()}
            sumr = result.metrics["sumr"]
            if sumr > state.best_sumr:
                state.best_sumr, state.best_epoch, state.bad_epochs = sumr, epoch, 0
                blob = {"config": redact_nested(self.cfg.to_dict()), "epoch": epoch + 1, "val_sumr": sumr, "format": CHECKPOINT_FORMAT}
                _atomic_save(self._weights() | blob, self.best_path)
                self.mirror.push()
            else:
                state.bad_epochs += 1
        self.progress = Progress(**_broadcast(asdict(state)))
        self.progress.epoch = epoch
        if self.progress.best_epoch == epoch != previous_best:  # every rank: the final round reuses this evaluation
            self.best_val = (epoch, result)
        return metrics

    def report(self, epoch: int, metrics: dict[str, Any], t0: float, train_time: float) -> None:
        """One ``kind="epoch"`` round on every rank; rank 0 attaches the recovery checkpoint, which holds every
        rank's random state (gathered first: a collective every rank joins, after validation's broadcast)."""
        metrics.update(
            {
                "kind": "epoch",
                "epoch": epoch + 1,
                "lr": self.step_lr,
                "best/sumr": self.progress.best_sumr,
                "best/epoch": self.progress.best_epoch + 1,
                "time/train_s": train_time,
                "time/epoch_s": time.perf_counter() - t0,
            }
        )
        if self.setup_s is not None:  # the first epoch of this attempt
            metrics["time/setup_s"], self.setup_s = self.setup_s, None
        # what the epoch trained with beside the config: the ranks and each one's threads decide its numbers
        metrics["run/ranks"], metrics["run/threads"] = self.world, torch.get_num_threads()
        if self.device.type == "cpu":  # 0: no C++ kernels here, so torch's generator draws the dropout masks
            from prvrlab.models import random_bits

            metrics["run/native_kernels"] = int(random_bits.load() is not None)
        states = _gather(random_state(self.device))  # every rank's generators, on rank 0 (all ranks join)
        if self.rank != 0:
            self.session.report(metrics, None)
            return
        with scratch_dir() as tmp:
            state = self._weights() | {
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "progress": asdict(self.progress),
                "global_step": self.global_step,
                RANK_STATES: states,
            } | states[0]  # rank 0's also as before per-rank states (what an older prvrlab restores on every rank)
            if self.scaler.is_enabled():  # fp16: its loss scale and growth count (a disabled scaler has none)
                state["scaler"] = self.scaler.state_dict()
            torch.save(state, tmp / "state.pt")
            self.session.report(metrics, tmp)

    def final_evaluation(self) -> None:
        """The ``kind="final"`` round: the best model on ``eval.final_splits``, per-query ranks written."""
        t0 = time.perf_counter()
        final: dict[str, Any] = {"kind": "final", "best/sumr": self.progress.best_sumr, "best/epoch": self.progress.best_epoch + 1}
        final.update(self._evaluate_best())
        final.update(self.cfg.published.compare(final, collection=self.cfg.data.collection))  # <split>/<metric>_vs_published
        if self.rank == 0:
            self.mirror.push()
        final["time/final_s"] = time.perf_counter() - t0
        self.session.report(final, None)

    # ------------------------------------------------------------ the whole run

    def run(self) -> None:
        """All stages, in order."""
        t0 = time.perf_counter()
        self.setup()
        self.restore()
        train_model = self.wrap()
        self.setup_s = time.perf_counter() - t0
        first = self.progress.epoch + 1
        if self.should_stop():  # restored after the early stop (a crash in the final round): only that round is left
            first = self.cfg.train.epochs
        for epoch in range(first, self.cfg.train.epochs):
            t0 = time.perf_counter()
            metrics: dict[str, Any] = self.epoch_start(epoch)
            train_metrics, failure = self.train_epoch(epoch, train_model)
            if failure:
                self.session.report({"kind": "nonfinite", "epoch": epoch + 1, "error": failure})
                return
            metrics.update(train_metrics)
            metrics.update(self.epoch_end(epoch))
            train_time = time.perf_counter() - t0
            metrics.update(self.validate(epoch))
            self.report(epoch, metrics, t0, train_time)
            _maybe_inject_fault(epoch, self.rank, self.fault)
            if self.should_stop():
                break
        self.final_evaluation()

    # ------------------------------------------------------------ helpers

    def should_stop(self) -> bool:
        """Early stopping: more than ``patience`` epochs without improvement (reference), or ``patience`` of them."""
        bad, patience = self.progress.bad_epochs, self.cfg.train.early_stop_patience
        return bad > patience if self.cfg.train.early_stop == "official" else bad >= patience

    def _device(self) -> torch.device:
        if self.cfg.train.use_gpu:
            if not torch.cuda.is_available():
                raise RuntimeError(NO_CUDA.format(who="this worker"))
            dev = torch.device("cuda", self.session.local_rank % torch.cuda.device_count())
            torch.cuda.set_device(dev)
            return dev
        return torch.device("cpu")

    def _weights(self) -> dict[str, Any]:
        """The model's and the loss terms' state (what a checkpoint holds besides the optimiser)."""
        return {"model": self.model.state_dict(), "losses": self.system.losses.state_dict()}

    def _evaluate_best(self) -> dict[str, Any]:
        """Every rank evaluates its share with the best model (rank 0's checkpoint, broadcast) on
        ``eval.final_splits``; rank 0 returns the metrics and writes per-query ranks (others: {})."""
        from prvrlab.evaluation.metrics import save_ranks
        from prvrlab.evaluation.retrieval import evaluate

        cfg = self.cfg
        if self.rank == 0 and self.progress.best_epoch >= 0:
            if not self.best_path.exists():
                raise RuntimeError(
                    f"{self.best_path} is missing: the best model (epoch {self.progress.best_epoch + 1}) cannot be "
                    "evaluated (a retry on another node without the run's folder, or the folder was cleaned); "
                    "the last epoch's weights are not reported in its place"
                )
            self.model.load_state_dict(torch.load(self.best_path, map_location=self.device, weights_only=True)["model"])
        if _distributed():
            for tensor in self.model.state_dict().values():
                dist.broadcast(tensor, src=0)
        out: dict[str, Any] = {}
        available = {cfg.data.train_split, cfg.data.val_split, cfg.data.test_split}
        for split in cfg.eval.final_splits:
            if split not in available or split is None:
                continue
            result = self.best_val[1] if self._validated_best(split) else evaluate(
                self.model, self.collection, split, cfg.eval, device=self.device, amp_dtype=self.amp_dtype,
                rank=self.rank, world_size=self.world, resident=self.resident.get(split),
            )
            if result is not None:
                out.update(result.flat(f"{split}/"))
                save_ranks(self.run_dir / f"ranks_{split}.parquet", result.table)
        return out

    def _validated_best(self, split: str) -> bool:
        """Whether this attempt validated ``split`` with the best model (``best_val``: same weights, data and
        eval settings as the best checkpoint, so encoding the split again would repeat it)."""
        return split == self.cfg.data.val_split and self.best_val is not None and self.best_val[0] == self.progress.best_epoch


def train_worker(loop_config: dict[str, Any], session: Session | None = None) -> None:
    """What every Ray Train worker (or a Tune trial actor) runs.

    ``loop_config``: {"experiment": the resolved ExperimentConfig, "run_dir":
    folder for run files, "cpus_per_worker": float, "fault": optional test hook, "sync_to":
    optional object-store URI rank 0 pushes the run files to}.
    """
    TrainingLoop(
        loop_config["experiment"],
        session=session or RaySession(),
        run_dir=loop_config["run_dir"],
        cpus_per_worker=loop_config.get("cpus_per_worker", 1.0),
        fault=loop_config.get("fault"),
        sync_to=loop_config.get("sync_to"),
    ).run()


def run_local(
    experiment: ExperimentConfig | dict[str, Any], run_dir: str | Path, on_report=None, on_progress=None, sync_to: str | None = None
) -> LocalSession:
    """Run the loop in this process without Ray (single rank); a dict is validated first.

    ``on_report`` gets every reported round, ``on_progress`` every step's in-epoch progress,
    ``sync_to`` (an object-store URI) the run files.  The worker has ``train.cpus_per_worker`` CPUs, as
    a Ray worker (its torch threads: that rounded up, unless ``train.torch_threads``); unset: 1.
    """
    cfg = experiment if isinstance(experiment, ExperimentConfig) else validate(experiment)
    session = LocalSession(Path(run_dir) / "local_session", on_report=on_report, on_progress=on_progress)
    cpus = cfg.train.cpus_per_worker if cfg.train.cpus_per_worker is not None else 1.0
    train_worker({"experiment": cfg, "run_dir": str(run_dir), "cpus_per_worker": cpus, "sync_to": sync_to}, session)
    return session
