"""How many small trainings one device holds: 1, 2, 4, 8 concurrent processes and their total throughput.

Each process trains configs/gmmformer_synth.yaml (the ``small`` synthetic
preset, one worker, ``--epochs`` epochs) through the in-process worker -- what
``prvrlab train --no-ray`` and a one-worker trial run -- and reports when its
epochs started and ended and how many videos it trained.  For each count the
script prints the total videos/s over the window where the processes trained
(first epoch start to last epoch end), the ratio to one process of the same
run, the mean per-process videos/s and, on CUDA, each process's peak GPU memory
(allocated).  A total that keeps rising with the count is what a search gains by
packing trials on one GPU (``resources.gpus_per_worker: 1 / count``).

Needs neither Ray nor MLflow (the reports come to the script).

    python3 benchmarks/bench_packing.py --device cuda --counts 1 2 4 8
    .venv/bin/python benchmarks/bench_packing.py --counts 1 2 --epochs 1 --amp none   # CPU: a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from _common import REPO, machine

MARK = "PACKING_RESULT "


def child(args: argparse.Namespace) -> None:
    """One training; prints ``MARK`` + JSON of its epoch window, videos trained and peak GPU memory."""
    from prvrlab.platform.config import load_config
    from prvrlab.platform.train.loop import run_local

    torch.set_num_threads(args.threads)
    cuda = torch.device(args.device).type == "cuda"
    overrides = {
        "data.root": str(args.root),
        "data.synthesize": None,
        "train.num_workers": 1,
        "train.epochs": args.epochs,
        "train.early_stop_patience": args.epochs + 1,
        "train.amp": args.amp,
        "train.use_gpu": cuda,
        "eval.final_splits": ["val"],
    }
    cfg = load_config(REPO / "configs" / args.config, overrides)
    starts, ends = [], []

    def on_report(m: dict) -> None:
        if m.get("kind") == "epoch":
            now = time.time()
            ends.append(now)
            starts.append(now - m["time/epoch_s"])

    with tempfile.TemporaryDirectory(prefix="bench_packing_") as run_dir:
        run_local(cfg, run_dir, on_report=on_report)
    from prvrlab.data.collection import open_collection

    videos = len(open_collection(cfg.data).split("train").video_ids) * len(ends)
    peak = torch.cuda.max_memory_allocated(args.device) / 2**30 if cuda else float("nan")
    print(MARK + json.dumps({"start": min(starts), "end": max(ends), "videos": videos, "peak_gib": peak}), flush=True)


def run_count(count: int, args: argparse.Namespace) -> dict:
    """``count`` concurrent children; their total and per-process throughput."""
    cmd = [sys.executable, __file__, "--child", "--root", str(args.root), "--config", args.config,
           "--epochs", str(args.epochs), "--amp", args.amp, "--device", args.device, "--threads", str(args.threads)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    t0 = time.time()
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(count)]
    results = []
    for proc in procs:
        out, err = proc.communicate()
        lines = [line for line in out.splitlines() if line.startswith(MARK)]
        if proc.returncode or not lines:
            raise SystemExit(f"a child failed (exit {proc.returncode}):\n{err[-3000:]}")
        results.append(json.loads(lines[-1][len(MARK):]))
    window = max(r["end"] for r in results) - min(r["start"] for r in results)
    videos = sum(r["videos"] for r in results)
    return {
        "count": count,
        "wall_s": time.time() - t0,
        "window_s": window,
        "total": videos / window,
        "per_process": sum(r["videos"] / (r["end"] - r["start"]) for r in results) / count,
        "peaks": [r["peak_gib"] for r in results],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", type=Path, default=REPO / "data" / "bench_packing_small")
    p.add_argument("--config", default="gmmformer_synth.yaml")
    p.add_argument("--counts", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--amp", default="bf16", choices=["none", "bf16", "fp16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2, help="torch threads per process")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    from prvrlab.data.synth import synthesize

    if not (args.root / "synth.json").exists():
        synthesize(args.root, preset="small", seed=0, progress=False)
    print(f"machine: {machine()}; {os.cpu_count()} CPUs")
    if torch.device(args.device).type == "cuda":
        print(f"device: {torch.cuda.get_device_name(args.device)}")
    print(f"{args.config} on the small preset, {args.epochs} epochs per process, amp {args.amp}, {args.device}, "
          f"{args.threads} threads per process")
    base = None
    for count in args.counts:
        r = run_count(count, args)
        base = base or r["total"]
        peaks = ", ".join(f"{g:.2f}" for g in r["peaks"])
        print(f"{count} process(es): total {r['total']:7.1f} videos/s ({r['total'] / base:.2f}x {args.counts[0]}), "
              f"{r['per_process']:6.1f} videos/s each; training window {r['window_s']:.1f} s, wall {r['wall_s']:.1f} s"
              + (f"; peak GPU memory per process {peaks} GiB" if torch.device(args.device).type == "cuda" else ""),
              flush=True)


if __name__ == "__main__":
    main()
