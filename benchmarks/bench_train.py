"""End-to-end training throughput at TVR scale, per worker.

Trains GMMFormer (configs/gmmformer_tvr.yaml: hidden 384, batch 128 videos,
~640 queries) on a TVR-shaped synthetic collection through the platform's own
loader, model, losses and optimiser, and prints for each precision:

- data seconds per batch (waiting on the loader: memory-mapped BigFile reads,
  preprocessing, collation), step seconds (forward + losses + backward +
  optimiser), end-to-end seconds per batch, videos/s and queries/s;
- peak resident memory.

REFERENCE.md §8 (official GMMFormer on this machine kind, fp32, 2 threads):
12.8 s per step + 5.3 s data per batch = 18.1 s per batch (~7 videos/s).

    .venv/bin/python benchmarks/bench_train.py --steps 4
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

import torch

from _common import add_host_allocator_option, machine, peak_rss_gib, reset_peak_rss, tvr_bench_collection, tvr_config
from prvrlab.allocator import set_host_allocator
from prvrlab.data.collection import open_collection
from prvrlab.data.dataset import train_loader
from prvrlab.evaluation.retrieval import resolve_amp_dtype
from prvrlab.losses.weighted import WeightedLoss
from prvrlab.platform.train.optim import build_optimizer
from prvrlab.models.factory import build_model
from prvrlab.platform.train.loop import seed_everything

REFERENCE_BATCH_S = 12.8 + 5.3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default="data/bench_tvr", help="where the TVR-shaped collection is (written once)")
    p.add_argument("--train-videos", type=int, default=1280)
    p.add_argument("--steps", type=int, default=4, help="timed steps per precision")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--loader-workers", type=int, default=0)
    p.add_argument("--amp", nargs="+", default=["none", "bf16"], choices=["none", "bf16"])
    add_host_allocator_option(p)
    args = p.parse_args()
    set_host_allocator(args.host_allocator)

    torch.set_num_threads(args.threads)
    root = tvr_bench_collection(Path(args.root), args.train_videos, 500, 2179)
    print(f"machine: {machine()}")
    print(f"reference (official GMMFormer, fp32): {REFERENCE_BATCH_S:.1f} s per 128-video batch "
          f"({128 / REFERENCE_BATCH_S:.1f} videos/s)")
    for arm, amp in enumerate(args.amp):
        gc.collect()  # the previous precision's model, optimiser and loader are gone: its peak is not this one's
        reset_peak_rss()
        cfg = tvr_config(root, **{"train.amp": amp, "data.loader_workers": args.loader_workers})
        seed_everything(0)
        collection = open_collection(cfg.data)
        model = build_model(cfg.model, cfg.plugins, video_dim=collection.video_dim, query_dim=collection.query_dim)
        losses = WeightedLoss.from_config(cfg.losses)
        loader, _ = train_loader(
            collection, "train", batch_size_per_rank=cfg.train.batch_size, rank=0, world_size=1,
            seed=arm, num_workers=args.loader_workers,  # other batches than the previous precision read
        )
        opt, sched = build_optimizer(model, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay,
                                     total_steps=1000, warmup_proportion=0.01)
        dtype = resolve_amp_dtype(amp)
        data_s, step_s, videos, queries = [], [], 0, 0
        it = iter(loader)
        for step in range(args.steps + 1):
            t0 = time.perf_counter()
            batch = next(it)
            t1 = time.perf_counter()
            with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
                out = model(batch)
            res = losses(out, batch, epoch=0)
            opt.zero_grad(set_to_none=True)
            res.total.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            t2 = time.perf_counter()
            if step == 0:
                continue  # warm-up
            data_s.append(t1 - t0)
            step_s.append(t2 - t1)
            videos += batch.num_videos
            queries += batch.num_queries
        total = sum(data_s) + sum(step_s)
        per_batch = total / args.steps
        print(
            f"[{amp:>4}] data {sum(data_s) / args.steps:5.2f} s/batch  step {sum(step_s) / args.steps:5.2f} s/batch  "
            f"end-to-end {per_batch:5.2f} s/batch  {videos / total:5.1f} videos/s  {queries / total:6.1f} queries/s  "
            f"({REFERENCE_BATCH_S / per_batch:.1f}x the reference, another machine's figure)  "
            f"peak RSS {peak_rss_gib():.2f} GiB (this precision's)"
        )
        del model, losses, loader, opt, sched, it, batch, out, res, collection


if __name__ == "__main__":
    main()
