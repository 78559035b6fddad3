"""Evaluation time and peak memory at TVR scale.

Evaluates an (untrained) GMMFormer of configs/gmmformer_tvr.yaml with the
platform's evaluator, on a TVR-shaped synthetic collection:

- `val`: 500 videos x 2,500 queries, the setting of REFERENCE.md §8 where the
  official GMMFormer takes 30 s (17-22 s of it loading features);
- `test`: TVR's full test size, 2,179 videos x 10,895 queries.

Prints loading+encoding of videos, encoding of queries, scoring+ranking, total,
and peak resident memory.

    .venv/bin/python benchmarks/bench_eval.py
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from _common import machine, peak_rss_gib, tvr_bench_collection, tvr_config
from prvrlab.data.collection import open_collection
from prvrlab.evaluation.retrieval import evaluate
from prvrlab.models.factory import build_model
from prvrlab.platform.train.loop import seed_everything


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default="data/bench_tvr")
    p.add_argument("--train-videos", type=int, default=1280)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--splits", nargs="+", default=["val", "test"])
    p.add_argument("--amp", nargs="+", default=["none", "bf16"], choices=["none", "bf16"])
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    root = tvr_bench_collection(Path(args.root), args.train_videos, 500, 2179)
    print(f"machine: {machine()}")
    print("reference (official GMMFormer, fp32): 30 s for 2,500 queries x 500 videos")
    cfg = tvr_config(root)
    seed_everything(0)
    t0 = time.perf_counter()
    collection = open_collection(cfg.data)
    print(f"open + check collection: {time.perf_counter() - t0:.1f} s")
    model = build_model(cfg.model, cfg.plugins, video_dim=collection.video_dim, query_dim=collection.query_dim)
    for amp in args.amp:
        for split in args.splits:
            res = evaluate(model, collection, split, cfg.eval, device=torch.device("cpu"), amp_dtype=amp)
            t = res.timings
            print(
                f"[{amp:>4}] {split:<4} {res.num_queries:>6} queries x {res.num_videos:>5} videos: "
                f"videos {t.get('encode_videos', 0):5.1f} s  queries {t.get('encode_queries', 0):5.1f} s  "
                f"scoring {t.get('score', 0):5.1f} s  total {res.seconds:5.1f} s  "
                f"peak RSS {peak_rss_gib():.2f} GiB"
            )


if __name__ == "__main__":
    main()
