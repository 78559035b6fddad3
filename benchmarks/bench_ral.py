"""The cost of the RAL plug-in on GMMFormer v2 (paper 000 reports +0.32 GFLOPs,
+3.26 M parameters and 6.73 -> 7.86 ms per query at 2,500 videos).

For configs/gmmformer_v2_tvr.yaml without and with `plugins.ral` (MSRA + CSA,
K = 6, with the ral_da / ral_pm loss terms), on a TVR-shaped synthetic
collection: training seconds per 128-video batch (data excluded, bf16 autocast
by default) and the efficiency profile (parameters, FLOPs, ms per query at
gallery sizes; MSRA is training-only, so only CSA appears at retrieval).

    .venv/bin/python benchmarks/bench_ral.py --steps 2
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from _common import machine, peak_rss_gib, tvr_bench_collection, tvr_config
from prvrlab.data.collection import open_collection
from prvrlab.data.dataset import train_loader
from prvrlab.evaluation.retrieval import resolve_amp_dtype
from prvrlab.losses.weighted import WeightedLoss
from prvrlab.platform.train.optim import build_optimizer
from prvrlab.models.factory import build_model
from prvrlab.platform.train.loop import seed_everything
from prvrlab.reports.profile import profile_config, profile_table

RAL = {
    "plugins.ral.msra": True,
    "plugins.ral.csa": True,
    "plugins.ral.num_proxies": 6,
    "losses.ral_da.loss": "ral_da",
    "losses.ral_da.weight": 2.5e-4,
    "losses.ral_pm.loss": "ral_pm",
    "losses.ral_pm.weight": 4.0e-3,
}


def step_seconds(cfg, collection, steps: int, amp: str) -> float:
    """Mean seconds of forward + losses + backward + optimiser over ``steps`` batches."""
    seed_everything(0)
    model = build_model(cfg.model, cfg.plugins, video_dim=collection.video_dim, query_dim=collection.query_dim)
    losses = WeightedLoss.from_config(cfg.losses)
    loader, _ = train_loader(collection, "train", batch_size_per_rank=cfg.train.batch_size, rank=0,
                             world_size=1, seed=0, num_workers=0)
    opt, _ = build_optimizer(model, lr=1e-4, weight_decay=0.01, total_steps=100, warmup_proportion=0.0)
    dtype = resolve_amp_dtype(amp)
    batches = iter(loader)
    times = []
    for i in range(steps + 1):
        batch = next(batches)
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            out = model(batch)
        res = losses(out, batch, epoch=0)
        opt.zero_grad(set_to_none=True)
        res.total.backward()
        opt.step()
        if i:
            times.append(time.perf_counter() - t0)
    return sum(times) / len(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default="data/bench_tvr")
    p.add_argument("--train-videos", type=int, default=1280)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--amp", default="bf16", choices=["none", "bf16"])
    p.add_argument("--gallery", type=int, nargs="+", default=[500, 2500])
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    root = tvr_bench_collection(Path(args.root), args.train_videos, 500, 2179)
    print(f"machine: {machine()}")
    variants = {"gmmformer_v2": {}, "gmmformer_v2 + RAL": RAL}
    profiles = []
    for name, extra in variants.items():
        cfg = tvr_config(root, "gmmformer_v2_tvr.yaml", **{"data.test_split": "test", **extra})
        collection = open_collection(cfg.data)
        seconds = step_seconds(cfg, collection, args.steps, args.amp)
        print(f"{name:<20} training step ({args.amp}) {seconds:6.2f} s / 128-video batch   peak RSS {peak_rss_gib():.2f} GiB")
        profiles.append(profile_config(cfg, galleries=args.gallery, name=name))
    print(profile_table(profiles))


if __name__ == "__main__":
    main()
