"""Peak resident memory of one training step, phase by phase, against issue 16's 4 GB target.

Trains GMMFormer v2 (configs/gmmformer_v2_tvr.yaml by default: hidden 384,
8 Gaussian branches, batch 128 videos / 640 queries, frames <= 128) on a
TVR-shaped synthetic collection through the platform's loader, model,
losses and optimiser, the way the training loop calls them, and prints for
each phase (data batch, forward, loss, backward, optimiser) the resident
memory at its start and its peak (a thread samples /proc/self/statm every
2 ms), plus the largest tensors autograd saved for the backward, grouped by
shape: what holds the memory.

Each setting runs in a fresh process (``--setting``), so one setting's peak
never hides another's; by default both ``train.checkpoint_activations``
false (the plain path) and true run.

Measured 2026-11-23 (AMD EPYC Zen 3, 2 threads, fp32, v2 at batch 128): step
peak 6.51 GiB one pass, 3.34 GiB with ``train.checkpoint_activations``
(step 2, AdamW states included); see docs/performance.md, "Memory (issue 16, second part)".

    .venv/bin/python benchmarks/bench_memory.py
    .venv/bin/python benchmarks/bench_memory.py --config gmmformer_tvr.yaml --setting off
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import torch

from _common import add_host_allocator_option, machine, tvr_bench_collection, tvr_config
from prvrlab.allocator import set_host_allocator
from prvrlab.data.collection import open_collection
from prvrlab.data.dataset import train_loader
from prvrlab.models.base import set_activation_checkpointing
from prvrlab.models.factory import build_system
from prvrlab.platform.train.loop import seed_everything
from prvrlab.platform.train.optim import build_optimizer

TARGET_GIB = 4e9 / 2**30  # issue 16: <= 4 GB for a v2 step at batch 128
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_gib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE / 2**30


class PhaseSampler:
    """Samples the resident set in a thread; records the start and the peak of each named phase."""

    def __init__(self, interval_s: float = 0.002) -> None:
        self.interval_s, self.phase, self.peaks, self.starts = interval_s, None, {}, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.phase is not None:
                self.peaks[self.phase] = max(self.peaks.get(self.phase, 0.0), rss_gib())
            time.sleep(self.interval_s)

    def enter(self, phase: str) -> None:
        now = rss_gib()
        if self.phase is not None:  # close the previous phase with a last sample
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0.0), now)
        self.phase = phase
        self.starts[phase] = now
        self.peaks[phase] = max(self.peaks.get(phase, 0.0), now)

    def stop(self) -> None:
        self.enter("end")
        self._stop.set()
        self._thread.join()


class SavedTensors(torch.autograd.graph.saved_tensors_hooks):
    """Bytes autograd saves for the backward, by (dtype, shape) (storages counted once)."""

    def __init__(self) -> None:
        self.by_shape: dict[tuple[str, tuple[int, ...]], int] = defaultdict(int)
        self.seen: set[int] = set()
        super().__init__(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cpu" and t.layout == torch.strided:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in self.seen:
                self.seen.add(ptr)
                self.by_shape[(str(t.dtype).replace("torch.", ""), tuple(t.shape))] += t.untyped_storage().nbytes()
        return t

    def report(self, top: int = 8) -> None:
        total = sum(self.by_shape.values())
        print(f"  saved for backward: {total / 2**30:.2f} GiB in {len(self.seen)} storages; largest:")
        for (dtype, shape), nbytes in sorted(self.by_shape.items(), key=lambda kv: -kv[1])[:top]:
            print(f"    {nbytes / 2**30:6.2f} GiB  {dtype} {shape}")


def run_setting(args, checkpoint: bool) -> None:
    torch.set_num_threads(args.threads)
    root = tvr_bench_collection(Path(args.root), args.train_videos, args.val_videos, args.test_videos)
    overrides = {"train.amp": args.amp, "train.checkpoint_activations": checkpoint, "train.batch_size": args.batch}
    cfg = tvr_config(root, args.config, **overrides)
    seed_everything(0)
    collection = open_collection(cfg.data)
    system = build_system(cfg.model, cfg.plugins, cfg.losses,
                          video_dim=collection.video_dim, query_dim=collection.query_dim)
    set_activation_checkpointing(system, cfg.train.checkpoint_activations)
    loader, _ = train_loader(collection, "train", batch_size_per_rank=cfg.train.batch_size, rank=0, world_size=1,
                             seed=0, num_workers=0)
    opt, sched = build_optimizer(system, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay,
                                 total_steps=1000, warmup_proportion=0.01)
    dtype = {"none": None, "bf16": torch.bfloat16}[args.amp]
    it = iter(loader)
    print(f"[checkpoint_activations={checkpoint}] {cfg.model['name']} batch {cfg.train.batch_size}, amp {args.amp}; "
          f"RSS after setup {rss_gib():.2f} GiB")
    for step in range(args.steps):
        sampler, saved, t0 = PhaseSampler(), SavedTensors(), time.perf_counter()
        sampler.enter("data")
        batch = next(it)
        sampler.enter("forward")
        with saved, torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            out = system.model(batch)
            sampler.enter("loss")
            with torch.autocast("cpu", enabled=False):
                result = system.losses(out, batch, epoch=0)
        sampler.enter("backward")
        opt.zero_grad(set_to_none=True)
        result.total.backward()
        sampler.enter("optimizer")
        opt.step()
        sched.step()
        sampler.stop()
        seconds = time.perf_counter() - t0
        shape = f"{batch.num_videos} videos x {batch.frames.shape[1]} frames, {batch.num_queries} queries"
        print(f" step {step + 1} ({shape}, {seconds:.1f} s, loss {float(result.total.detach()):.6f}):")
        for phase in ("data", "forward", "loss", "backward", "optimizer"):
            print(f"  {phase:<9} start {sampler.starts[phase]:5.2f} GiB  peak {sampler.peaks[phase]:5.2f} GiB")
        peak = max(sampler.peaks.values())
        verdict = "within" if peak <= TARGET_GIB else "OVER"
        print(f"  step peak {peak:.2f} GiB: {verdict} the 4 GB ({TARGET_GIB:.2f} GiB) target")
        saved.report()
        del batch, out, result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default="data/bench_tvr_memory", help="its own sizes: not the folder the other benchmarks share")
    p.add_argument("--train-videos", type=int, default=256)
    p.add_argument("--val-videos", type=int, default=500)
    p.add_argument("--test-videos", type=int, default=20)
    p.add_argument("--config", default="gmmformer_v2_tvr.yaml")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--amp", default="none", choices=["none", "bf16"])
    p.add_argument("--steps", type=int, default=2, help="steps per setting (the first includes warm-up)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--setting", choices=["off", "on"], help="run one setting in this process (internal)")
    add_host_allocator_option(p)
    args = p.parse_args()
    set_host_allocator(args.host_allocator)
    if args.setting is not None:
        run_setting(args, checkpoint=args.setting == "on")
        return
    print(f"machine: {machine()}; load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    for setting in ("off", "on"):  # a fresh process each: peaks never carry over
        subprocess.run([sys.executable, *sys.argv, "--setting", setting], check=True)


if __name__ == "__main__":
    main()
