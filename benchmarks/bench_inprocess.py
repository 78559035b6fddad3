"""Train through the in-process worker -- what ``prvrlab train --no-ray`` runs -- on any device.

For each config (GMMFormer and GMMFormer v2 at TVR's dimensions by default) on a
TVR-shaped synthetic collection (the one benchmarks/bench_eval.py uses), runs
the platform's training loop in this process (``run_local``: loader, model,
losses, optimiser, per-epoch validation, checkpoints, the final evaluation) and
prints, per epoch, the training loss, val SumR and seconds, then the median
seconds per step and videos/s over the epochs after the first (warm-up), peak
GPU memory on CUDA (peak RSS on CPU), and whether the loss fell.

``--compare-syncs`` trains each config a second time with the host waiting for the device
after every forward and every optimiser step, as the loop did before it waited once per
step (after the backward pass, for the non-finite-loss flag): a same-run baseline.

``--sync-sites`` (CUDA) lists where the host waits for the device inside training steps: each
step runs under ``torch.cuda.set_sync_debug_mode("warn")`` and every synchronising call is
counted at the innermost line of prvrlab's own code on the stack (per step: the loop's one wait
plus whatever a backbone, plug-in or loss adds).

A config may carry overrides after ``+`` (``mamfusion_tvr.yaml+model.mamba_residual=zero_init``;
values read as YAML), so one run compares a recipe with and without a switch.

The worker's reports come to this script, not to MLflow: it needs neither Ray
nor MLflow, so it also runs where they are not installed (the GPU image).

    python3 benchmarks/bench_inprocess.py --device cuda --epochs 20            # 200 steps per model
    .venv/bin/python benchmarks/bench_inprocess.py --train-videos 256 --val-videos 64 --test-videos 64 \\
        --epochs 2 --amp none --configs gmmformer_tvr.yaml                     # a quick look on the CPU
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import traceback
import warnings
from collections import Counter
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import yaml

from _common import add_collection_options, bench_collection, machine, peak_rss_gib, tvr_config
from prvrlab.platform.train.loop import run_local


@contextmanager
def synced_steps(device: torch.device):
    """The host waits for ``device`` after each forward and each optimiser step (the loop's syncs before session 12)."""
    from prvrlab.models.factory import TrainingSystem
    from prvrlab.platform.train.loop import TrainingLoop

    forward, step = TrainingSystem.forward, TrainingLoop.step

    def wait() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def synced_forward(self, *a, **k):
        out = forward(self, *a, **k)
        wait()
        return out

    def synced_step(self, *a, **k):
        out = step(self, *a, **k)
        wait()
        return out

    TrainingSystem.forward, TrainingLoop.step = synced_forward, synced_step
    try:
        yield
    finally:
        TrainingSystem.forward, TrainingLoop.step = forward, step


def innermost_own_frame(stack: list[traceback.FrameSummary]) -> str:
    """``file:line`` of the innermost frame in prvrlab's package (else the innermost frame): where a sync is asked for."""
    own = [f for f in stack if f"{os.sep}prvrlab{os.sep}" in f.filename]
    frame = (own or stack)[-1]
    path = frame.filename.split(f"{os.sep}prvrlab{os.sep}", 1)[-1] if own else frame.filename
    return f"{path}:{frame.lineno}"


@contextmanager
def counted_syncs(sites: Counter, steps: list[int]):
    """Count the host's waits for the CUDA device inside each training step by :func:`innermost_own_frame`."""
    from prvrlab.platform.train.loop import TrainingLoop

    step = TrainingLoop.step

    def counted_step(self, *a, **k):
        def record(message, category, *_args, **_kwargs):
            if "synchroniz" in str(message):
                sites[innermost_own_frame(traceback.extract_stack()[:-1])] += 1

        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return step(self, *a, **k)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                steps[0] += 1

    TrainingLoop.step = counted_step
    try:
        yield
    finally:
        TrainingLoop.step = step


def split_config(spec: str) -> tuple[str, dict]:
    """``name.yaml+key=value+...`` -> the config's file name and its overrides (values read as YAML)."""
    name, *pairs = spec.split("+")
    switches = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--configs {spec}: '{pair}' is not KEY=VALUE")
        switches[key] = yaml.safe_load(value)
    return name, switches


def train_one(root: Path, config: str, args: argparse.Namespace, *, synced: bool = False, syncs: bool = False) -> dict:
    """Train ``config`` in this process; the per-epoch reports and the figures derived from them."""
    cuda = torch.device(args.device).type == "cuda"
    overrides = {
        "train.epochs": args.epochs,
        "train.amp": args.amp,
        "train.use_gpu": cuda,
        "data.loader_workers": args.loader_workers,
        "data.pin_memory": {"auto": None, "on": True, "off": False}[args.pin_memory],
        "data.resident": args.resident,
        "eval.final_splits": ["val"],
    }
    if args.batch is not None:
        overrides["train.batch_size"] = args.batch
    name, switches = split_config(config)
    cfg = tvr_config(root, name, **overrides, **switches)
    epochs: list[dict] = []

    def on_report(m: dict) -> None:
        if m.get("kind") != "epoch":
            return
        epochs.append(m)
        print(f"  epoch {m['epoch']:>3}/{args.epochs}  loss {m['train/loss']:.4f}  val SumR {m.get('val/sumr', float('nan')):6.1f}  "
              f"train {m['time/train_s']:6.2f} s  epoch {m['time/epoch_s']:6.2f} s", flush=True)

    if cuda:
        torch.cuda.reset_peak_memory_stats(args.device)
    sites: Counter = Counter()
    counted = [0]
    with tempfile.TemporaryDirectory(prefix="bench_inprocess_") as run_dir, \
            (synced_steps(torch.device(args.device)) if synced else nullcontext()), \
            (counted_syncs(sites, counted) if syncs else nullcontext()):
        run_local(cfg, run_dir, on_report=on_report)
    if syncs:
        print(f"{config}: host waits inside {counted[0]} training steps, per step by where they are asked for:")
        for site, n in sites.most_common():
            print(f"  {n / max(counted[0], 1):6.2f}  {site}")
        print(f"  {sum(sites.values()) / max(counted[0], 1):6.2f}  in all", flush=True)
    steps = math.ceil(args.train_videos / cfg.train.batch_size)
    timed = epochs[1:] or epochs
    train_s = statistics.median(m["time/train_s"] for m in timed)
    return {
        "config": config + (" (synced steps)" if synced else ""),
        "steps": steps * len(epochs),
        "step_s": train_s / steps,
        "videos_s": args.train_videos / train_s,
        "peak_gib": torch.cuda.max_memory_allocated(args.device) / 2**30 if cuda else peak_rss_gib(),
        "first_loss": epochs[0]["train/loss"],
        "last_loss": epochs[-1]["train/loss"],
        "best_sumr": max(m.get("val/sumr", float("nan")) for m in epochs),
        "first_sumr": epochs[0].get("val/sumr", float("nan")),
        "setup_s": epochs[0].get("time/setup_s", float("nan")),  # data (a resident split's load), model, optimiser
        "val_s": statistics.median(m["time/epoch_s"] - m["time/train_s"] for m in timed),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_collection_options(p)
    p.add_argument("--configs", nargs="+", default=["gmmformer_tvr.yaml", "gmmformer_v2_tvr.yaml"],
                   help="config files in configs/, each optionally with +KEY=VALUE overrides")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch", type=int, default=None, help="train.batch_size (default: the config's, 128)")
    p.add_argument("--amp", default="bf16", choices=["none", "bf16", "fp16"])
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--loader-workers", type=int, default=0, help="data.loader_workers")
    p.add_argument("--pin-memory", choices=("auto", "on", "off"), default="auto",
                   help="data.pin_memory (auto: page-locked batches when training on CUDA)")
    p.add_argument("--resident", action="store_true",
                   help="data.resident: the training and validation splits held on the device, batched there (no loader)")
    p.add_argument("--compare-syncs", action="store_true",
                   help="train each config again with the host waiting for the device after every forward and "
                        "optimiser step (the loop before it waited once per step)")
    p.add_argument("--sync-sites", action="store_true",
                   help="CUDA: count the host's waits for the device inside training steps, by prvrlab source line")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    if args.sync_sites and torch.device(args.device).type != "cuda":
        raise SystemExit("--sync-sites counts waits for a CUDA device: add --device cuda")

    for config in args.configs:
        split_config(config)  # a malformed override stops the run before any training
    torch.set_num_threads(args.threads)
    root = bench_collection(args)
    print(f"machine: {machine()}")
    if torch.device(args.device).type == "cuda":
        print(f"device: {torch.cuda.get_device_name(args.device)}")
    rows = []
    for config in args.configs:
        print(f"{config}: {args.epochs} epochs of {args.train_videos} videos, amp {args.amp}, {args.device}, "
              f"{args.loader_workers} loader workers, pin_memory {args.pin_memory}, resident {args.resident}", flush=True)
        rows.append(train_one(root, config, args, syncs=args.sync_sites))
        if args.compare_syncs:
            print(f"{config}: again, the host waiting for the device after each forward and optimiser step", flush=True)
            rows.append(train_one(root, config, args, synced=True))
    memory = "peak GPU memory (allocated)" if torch.device(args.device).type == "cuda" else "peak RSS"
    for r in rows:
        fell = "falls" if r["last_loss"] < r["first_loss"] else "DOES NOT FALL"
        print(f"{r['config']}: {r['steps']} steps; {r['step_s'] * 1000:.0f} ms/step (data included, median epoch after the "
              f"first), {r['videos_s']:.0f} videos/s; {memory} {r['peak_gib']:.2f} GiB; loss {r['first_loss']:.4f} -> "
              f"{r['last_loss']:.4f} ({fell}); val SumR {r['first_sumr']:.1f} after epoch 1, best {r['best_sumr']:.1f}; "
              f"set-up {r['setup_s']:.1f} s, validation and checkpoints {r['val_s']:.2f} s per epoch")
    if args.compare_syncs:
        for loop, synced in zip(rows[::2], rows[1::2]):
            print(f"{loop['config']}: synced / one wait per step = {synced['step_s'] / loop['step_s']:.3f} (ms/step "
                  f"{synced['step_s'] * 1000:.1f} / {loop['step_s'] * 1000:.1f}); final loss {synced['last_loss']:.6f} / "
                  f"{loop['last_loss']:.6f}")


if __name__ == "__main__":
    main()
