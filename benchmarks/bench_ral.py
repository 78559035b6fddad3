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
from pathlib import Path

import torch

from _common import bench_system, machine, peak_rss_gib, step_seconds, tvr_bench_collection, tvr_config
from prvrlab.data.collection import open_collection
from prvrlab.evaluation.profile import profile_config
from prvrlab.reports.profile import profile_table

RAL = {
    "plugins.ral.msra": True,
    "plugins.ral.csa": True,
    "plugins.ral.num_proxies": 6,
    "losses.ral_da.loss": "ral_da",
    "losses.ral_da.weight": 2.5e-4,
    "losses.ral_pm.loss": "ral_pm",
    "losses.ral_pm.weight": 4.0e-3,
}




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
        seconds = step_seconds(bench_system(cfg, collection), collection, batch_size=cfg.train.batch_size,
                               steps=args.steps, amp=args.amp)
        print(f"{name:<20} training step ({args.amp}) {seconds:6.2f} s / 128-video batch   peak RSS {peak_rss_gib():.2f} GiB")
        profiles.append(profile_config(cfg, galleries=args.gallery, name=name))
    print(profile_table(profiles))


if __name__ == "__main__":
    main()
