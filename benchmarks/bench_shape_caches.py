"""Resident memory over training steps of different shapes: the caches of matrix products, capped or not.

Every training batch whose packed token counts differ makes new oneDNN matrix-product primitives,
forward and backward, and PyTorch keeps the computations built on them in its own cache
(``LRU_CACHE_CAPACITY``) beside oneDNN's (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``), 1,024 entries each by
default.  ``Trainer.setup`` caps both at 64 (``allocator.cap_primitive_caches``).  This runs bf16
training steps of a TVR-config backbone over ``--epochs`` shuffled epochs of ``--batch``-video batches,
once with the training caps and once with PyTorch's and oneDNN's defaults, each in a fresh process
(the caps are read at a process's first product), and prints the resident set after every epoch, the
malloc memory in use (glibc) and the mean step time.  One step's peak is ``bench_memory.py``'s.

    .venv/bin/python benchmarks/bench_shape_caches.py
    .venv/bin/python benchmarks/bench_shape_caches.py --config gmmformer_v2_tvr.yaml
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from _common import bench_system, machine, status_gib, tvr_bench_collection, tvr_config
from prvrlab.allocator import (
    COMPUTATION_CACHE_VARIABLE, PRIMITIVE_CACHE_VARIABLE, cap_primitive_caches, malloc_in_use, set_host_allocator,
)
from prvrlab.data.collection import open_collection
from prvrlab.data.dataset import train_loader
from prvrlab.platform.train.optim import build_optimizer


def run(args: argparse.Namespace) -> None:
    """One setting in this (fresh) process: ``capped`` as the trainer does, or the libraries' defaults."""
    if args.setting == "capped":
        cap_primitive_caches()
    set_host_allocator("keep")
    torch.set_num_threads(args.threads)
    root = tvr_bench_collection(Path(args.root), args.train_videos, 16, 16)
    cfg = tvr_config(root, args.config)
    collection = open_collection(cfg.data)
    system = bench_system(cfg, collection)
    optimizer, _ = build_optimizer(system, lr=1e-4, weight_decay=0.01, total_steps=10_000, warmup_proportion=0.0)
    system.train()
    for epoch in range(args.epochs):
        loader, _ = train_loader(collection, "train", batch_size_per_rank=args.batch, rank=0, world_size=1,
                                 seed=epoch, num_workers=0)
        seconds = []
        for batch in loader:
            t0 = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                result, _ = system(batch, epoch=epoch)
            optimizer.zero_grad(set_to_none=True)
            result.total.backward()
            optimizer.step()
            seconds.append(time.perf_counter() - t0)
        in_use = malloc_in_use()
        print(f"[{args.setting:>8}] epoch {epoch}: {len(seconds)} steps, RSS {status_gib('VmRSS'):.2f} GiB, "
              f"malloc in use {'-' if in_use is None else f'{in_use / 2**30:.2f} GiB'}, "
              f"step {sum(seconds) / len(seconds):.2f} s", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="gmmformer_tvr.yaml")
    p.add_argument("--root", default="data/bench_shape_caches", help="the TVR-shaped collection (written once)")
    p.add_argument("--train-videos", type=int, default=320)
    p.add_argument("--batch", type=int, default=32, help="videos a batch (5 queries each)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--setting", choices=["capped", "defaults"], help="internal: one setting in this process")
    args = p.parse_args()
    if args.setting is not None:
        run(args)
        return
    print(f"machine: {machine()}; {args.config}, bf16, batches of {args.batch} of {args.train_videos} videos")
    env = {k: v for k, v in os.environ.items() if k not in (PRIMITIVE_CACHE_VARIABLE, COMPUTATION_CACHE_VARIABLE)}
    for setting in ("capped", "defaults"):
        cmd = [sys.executable, __file__, "--setting", setting, *sys.argv[1:]]
        subprocess.run(cmd, check=True, env=env)


if __name__ == "__main__":
    main()
