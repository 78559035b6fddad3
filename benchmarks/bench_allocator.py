"""``train.host_allocator``: keep (the default) against system, training steps and an evaluation.

The setting is process-wide and a process's heap remembers it (freed blocks
stay reusable after switching back), so every measurement runs in a fresh
process; the settings alternate round by round, so both see the same machine
load.  Per round and setting it prints:

- ``step <backbone>``: the best of ``--steps`` fp32 training steps (after one
  warm-up) of bench_model_step.py's synthetic TVR-shaped batch (128 videos,
  32-128 real frames, 640 queries), forward + losses + backward + AdamW;
- ``eval``: one fp32 evaluation of 2,500 queries x 500 videos of
  bench_eval.py's collection (configs/gmmformer_tvr.yaml), whole split;

each with the process's peak resident memory (VmHWM), then the system / keep
time ratios (best over rounds) and the peaks.

    .venv/bin/python benchmarks/bench_allocator.py
    .venv/bin/python benchmarks/bench_allocator.py --work step:gmmformer --rounds 1   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from _common import machine, peak_rss_gib, tvr_bench_collection, tvr_config
from prvrlab.allocator import HOST_ALLOCATORS, host_allocator, set_host_allocator


def step_seconds(backbone: str, steps: int, threads: int) -> float:
    """Best fp32 training step of bench_model_step.py's default batch (variable lengths)."""
    import bench_model_step

    sys.argv = ["bench_model_step.py", "--backbone", backbone, "--min-frames", "32", "--threads", str(threads)]
    args = bench_model_step.parse_args()
    batch = bench_model_step.synthetic_batch(args, torch.Generator().manual_seed(args.seed))
    runner = bench_model_step.Runner(args, "none")
    runner.step(batch, record=False)
    for _ in range(steps):
        runner.step(batch, record=True)
    return min(runner.times["step"])


def eval_seconds(root: str) -> float:
    """One fp32 evaluation of the val split (2,500 queries x 500 videos)."""
    from prvrlab.data.collection import open_collection
    from prvrlab.evaluation.retrieval import evaluate
    from prvrlab.models.factory import build_model
    from prvrlab.platform.train.loop import seed_everything

    cfg = tvr_config(tvr_bench_collection(Path(root), 1280, 500, 2179), "gmmformer_tvr.yaml")
    seed_everything(0)
    collection = open_collection(cfg.data)
    model = build_model(cfg.model, cfg.plugins, video_dim=collection.video_dim, query_dim=collection.query_dim)
    t0 = time.perf_counter()
    evaluate(model, collection, "val", cfg.eval, device="cpu", amp_dtype="none")
    return time.perf_counter() - t0


def child(args: argparse.Namespace) -> None:
    """Apply the setting first, do one piece of work, print one JSON line."""
    applied = set_host_allocator(args.child)
    torch.set_num_threads(args.threads)
    kind, _, backbone = args.work[0].partition(":")
    seconds = step_seconds(backbone, args.steps, args.threads) if kind == "step" else eval_seconds(args.root)
    print(json.dumps({"seconds": seconds, "peak_gib": peak_rss_gib(), "applied": applied, "mode": host_allocator()}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", nargs="+", default=["step:gmmformer", "step:gmmformer_v2", "eval"],
                   help="step:<backbone> or eval")
    p.add_argument("--settings", nargs="+", choices=list(HOST_ALLOCATORS), default=["keep", "system"])
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds (best kept)")
    p.add_argument("--steps", type=int, default=2, help="timed steps per process after one warm-up")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--root", default="data/bench_tvr")
    p.add_argument("--child", choices=list(HOST_ALLOCATORS), help="internal: one measurement under this setting")
    args = p.parse_args()
    if args.child is not None:
        child(args)
        return
    if any(w == "eval" for w in args.work):
        tvr_bench_collection(Path(args.root), 1280, 500, 2179)  # written once, outside the timings
    print(f"machine: {machine()}; load average at start: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    best: dict[tuple[str, str], dict] = {}
    for work in args.work:
        for rnd in range(args.rounds):
            for setting in args.settings:
                cmd = [sys.executable, __file__, "--child", setting, "--work", work, "--steps", str(args.steps),
                       "--threads", str(args.threads), "--root", args.root]
                out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
                print(f"round {rnd + 1} {work:<18} {setting:<6} {out['seconds']:7.2f} s  peak RSS {out['peak_gib']:5.2f} GiB"
                      + ("" if out["applied"] else "  (not applied: no glibc; the system's allocator ran)"))
                key = (work, setting)
                if key not in best or out["seconds"] < best[key]["seconds"]:
                    best[key] = out
    if {"keep", "system"} <= set(args.settings):
        for work in args.work:
            keep, system = best[(work, "keep")], best[(work, "system")]
            print(f"{work:<18} keep over system: {system['seconds'] / keep['seconds']:.2f}x faster "
                  f"({system['seconds']:.2f} -> {keep['seconds']:.2f} s); peak RSS "
                  f"{system['peak_gib']:.2f} -> {keep['peak_gib']:.2f} GiB")
    print(f"load average at end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
