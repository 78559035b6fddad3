"""The training worker: one DDP rank of a run (or the whole run in-process).

``train_worker(loop_config, session)`` is what Ray Train's TorchTrainer runs
on every worker.  It only talks to a :class:`Session`, writes run files
(best model, per-query ranks) to the run folder, and never touches MLflow:
the driver is the one process that writes to the tracking store.

Reported rounds (every rank reports the same number of times):
- one per epoch: ``kind="epoch"`` with train losses, validation R@K/SumR,
  best-so-far, timings, and a checkpoint for failure recovery;
- one at the end: ``kind="final"`` with the best model's metrics on
  ``eval.final_splits`` and the run files written.
A non-finite loss ends training on every rank at the same step and is
reported as ``kind="nonfinite"`` (no retry: retrying cannot fix it).
"""

from __future__ import annotations

import math
import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from prvrlab.platform.config import ExperimentConfig, validate
from prvrlab.platform.train.session import LocalSession, RaySession, Session, scratch_dir

FAULT_EPOCH_ENV = "PRVRLAB_FAULT_EPOCH"  # test hook: crash rank 0 once after this epoch
FAULT_MARKER_ENV = "PRVRLAB_FAULT_MARKER"  # file that records the crash already happened


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (model init identical on every rank)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def build_model(cfg: ExperimentConfig, video_dim: int, query_dim: int) -> torch.nn.Module:
    """The configured backbone, looked up by its registered name, wrapped with the
    configured plug-ins (``PluggedModel``) when ``cfg.plugins`` is not empty."""
    from prvrlab.platform.config import backbone_hidden_size
    from prvrlab.registry import BACKBONES, PLUGINS

    params = {k: v for k, v in cfg.model.items() if k != "name"}
    backbone = BACKBONES.build(cfg.model["name"], video_dim=video_dim, query_dim=query_dim, **params)
    if not cfg.plugins:
        return backbone
    from prvrlab.models.plugins.base import PluggedModel

    width = backbone_hidden_size(cfg.model)
    plugins = {name: PLUGINS.build(name, hidden_size=width, **p) for name, p in cfg.plugins.items()}
    return PluggedModel(backbone=backbone, plugins=plugins)


def aux_metrics(aux: dict[str, Any]) -> dict[str, float]:
    """Scalars a model reports for logging: ``aux['metric.<name>']`` -> {'<name>': value}."""
    from prvrlab.models.plugins.base import METRIC_PREFIX

    return {
        key[len(METRIC_PREFIX) :]: float(value.detach())
        for key, value in aux.items()
        if key.startswith(METRIC_PREFIX) and isinstance(value, torch.Tensor) and value.numel() == 1
    }


def amp_dtype(cfg: ExperimentConfig) -> torch.dtype | None:
    return {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.train.amp]


def _device(cfg: ExperimentConfig, session: Session) -> torch.device:
    if cfg.train.use_gpu:
        if not torch.cuda.is_available():
            raise RuntimeError("train.use_gpu is true but this worker sees no CUDA device")
        dev = torch.device("cuda", session.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
        return dev
    return torch.device("cpu")


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    if _distributed():
        values = values.clone()
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def _broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not _distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def fault_hook_from_env() -> dict[str, Any] | None:
    """The driver-side test hook: crash rank 0 once after an epoch (see FAULT_*_ENV)."""
    epoch, marker = os.environ.get(FAULT_EPOCH_ENV), os.environ.get(FAULT_MARKER_ENV)
    if epoch is None or marker is None:
        return None
    return {"epoch": int(epoch), "marker": marker}


def _maybe_inject_fault(epoch: int, rank: int, hook: dict[str, Any] | None) -> None:
    """Kill this worker process once after ``hook['epoch']`` on rank 0 (tests)."""
    if hook is None or rank != 0 or hook["epoch"] != epoch or Path(hook["marker"]).exists():
        return
    Path(hook["marker"]).write_text(f"crashed after epoch {epoch}\n")
    time.sleep(hook.get("delay_s", 3.0))  # let the controller register the checkpoint
    os._exit(17)


def train_worker(loop_config: dict[str, Any], session: Session | None = None) -> None:
    """Train one run.

    ``loop_config``: {"experiment": config dict, "run_dir": folder for run files,
    "cpus_per_worker": float, "fault": optional test hook}.
    """
    cfg = validate(loop_config["experiment"])
    run_dir = Path(loop_config["run_dir"])
    session = session or RaySession()
    rank, world = session.rank, session.world_size

    threads = cfg.train.torch_threads or max(1, math.ceil(loop_config.get("cpus_per_worker", 1)))
    torch.set_num_threads(threads)
    device = _device(cfg, session)
    seed_everything(cfg.train.seed)

    from prvrlab.data.collection import open_collection
    from prvrlab.data.dataset import train_loader
    from prvrlab.losses.weighted import NonFiniteLossError, WeightedLoss
    from prvrlab.evaluation.retrieval import evaluate
    from prvrlab.platform.train.optim import build_optimizer

    collection = open_collection(cfg.data)
    model = build_model(cfg, collection.video_dim, collection.query_dim).to(device)
    loss_fn = WeightedLoss.from_config(cfg.losses).to(device)

    per_rank = max(1, cfg.train.batch_size // world)
    loader, sampler = train_loader(
        collection,
        cfg.data.train_split,
        batch_size_per_rank=per_rank,
        rank=rank,
        world_size=world,
        seed=cfg.train.seed,
        num_workers=cfg.data.loader_workers,
    )
    steps_per_epoch = len(sampler)
    optimizer, scheduler = build_optimizer(
        model,
        lr=cfg.train.lr,
        weight_decay=cfg.train.weight_decay,
        total_steps=steps_per_epoch * cfg.train.epochs,
        warmup_proportion=cfg.train.warmup_proportion,
    )

    state = {"epoch": -1, "best_sumr": -1.0, "best_epoch": -1, "bad_epochs": 0}
    with session.checkpoint_dir() as ckpt:
        if ckpt is not None:
            saved = torch.load(Path(ckpt) / "state.pt", map_location=device, weights_only=True)
            model.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
            scheduler.load_state_dict(saved["scheduler"])
            state = saved["progress"]
            torch.set_rng_state(saved["rng"])

    train_model = model
    if world > 1:
        ddp_kwargs = {"device_ids": [device.index]} if device.type == "cuda" else {}
        train_model = torch.nn.parallel.DistributedDataParallel(model, **ddp_kwargs)

    dtype = amp_dtype(cfg)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype is torch.float16)
    best_path = run_dir / "best_model.pt"
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)

    for epoch in range(state["epoch"] + 1, cfg.train.epochs):
        t0 = time.perf_counter()
        sampler.set_epoch(epoch)
        train_model.train()
        sums: dict[str, float] = {}
        steps = 0
        failure = ""
        for batch in loader:
            batch = batch.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
                out = train_model(batch)
            try:
                res = loss_fn(out, batch, epoch=epoch)
                bad = 0.0
            except NonFiniteLossError as exc:
                failure, bad = str(exc), 1.0
            if _all_reduce_sum(torch.tensor([bad], device=device)).item() > 0:
                failure = failure or "non-finite loss on another worker"
                break
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(res.total).backward()
            if cfg.train.grad_clip > 0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            steps += 1
            sums["loss"] = sums.get("loss", 0.0) + float(res.total.detach())
            for term, value in res.terms.items():
                sums[term] = sums.get(term, 0.0) + float(value)
            for name, value in aux_metrics(out.aux).items():  # e.g. train/ral.sigma_query
                sums[name] = sums.get(name, 0.0) + value
        if failure:
            session.report({"kind": "nonfinite", "epoch": epoch, "error": f"epoch {epoch}: {failure}"})
            return
        names = sorted(sums)
        totals = _all_reduce_sum(torch.tensor([sums[n] for n in names] + [steps], dtype=torch.float64))
        train_metrics = {f"train/{n}": float(totals[i] / max(1.0, totals[-1])) for i, n in enumerate(names)}
        train_time = time.perf_counter() - t0

        metrics: dict[str, Any] = {}
        if rank == 0:
            result = evaluate(model, collection, cfg.data.val_split, cfg.eval, device=device, amp_dtype=dtype)
            metrics = {f"val/{k}": v for k, v in result.metrics.items()}
            sumr = result.metrics["sumr"]
            if sumr > state["best_sumr"]:
                state.update(best_sumr=sumr, best_epoch=epoch, bad_epochs=0)
                _atomic_save({"model": model.state_dict(), "config": cfg.to_dict(), "epoch": epoch}, best_path)
            else:
                state["bad_epochs"] += 1
        state = _broadcast(state)
        state["epoch"] = epoch
        metrics.update(train_metrics)
        metrics.update(
            {
                "kind": "epoch",
                "epoch": epoch,
                "lr": scheduler.get_last_lr()[0],
                "best/sumr": state["best_sumr"],
                "best/epoch": state["best_epoch"],
                "time/train_s": train_time,
                "time/epoch_s": time.perf_counter() - t0,
            }
        )
        if rank == 0:
            with scratch_dir() as tmp:
                torch.save(
                    {
                        "model": model.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(),
                        "progress": state,
                        "rng": torch.get_rng_state(),
                    },
                    tmp / "state.pt",
                )
                session.report(metrics, tmp)
        else:
            session.report(metrics, None)
        _maybe_inject_fault(epoch, rank, loop_config.get("fault"))
        if state["bad_epochs"] >= cfg.train.early_stop_patience:
            break

    final: dict[str, Any] = {"kind": "final", "best/sumr": state["best_sumr"], "best/epoch": state["best_epoch"]}
    if rank == 0:
        final.update(_final_evaluation(cfg, collection, model, best_path, run_dir, device, dtype))
    session.report(final, None)


def _final_evaluation(cfg, collection, model, best_path: Path, run_dir: Path, device, dtype) -> dict[str, Any]:
    """Evaluate the best model on ``eval.final_splits``; write per-query ranks."""
    from prvrlab.evaluation.metrics import save_ranks
    from prvrlab.evaluation.retrieval import evaluate

    if best_path.exists():
        model.load_state_dict(torch.load(best_path, map_location=device, weights_only=True)["model"])
    out: dict[str, Any] = {}
    available = {cfg.data.train_split, cfg.data.val_split, cfg.data.test_split}
    for split in cfg.eval.final_splits:
        if split not in available or split is None:
            continue
        result = evaluate(model, collection, split, cfg.eval, device=device, amp_dtype=dtype)
        out.update({f"{split}/{k}": v for k, v in result.metrics.items()})
        for group, values in (result.by_group or {}).items():
            out.update({f"{split}/{group}/{k}": v for k, v in values.items()})
        save_ranks(run_dir / f"ranks_{split}.parquet", result.table)
    return out


def run_local(experiment: dict[str, Any], run_dir: str | Path, on_report=None) -> LocalSession:
    """Run the worker in this process without Ray (single rank)."""
    session = LocalSession(Path(run_dir) / "local_session", on_report=on_report)
    train_worker({"experiment": experiment, "run_dir": str(run_dir)}, session)
    return session
