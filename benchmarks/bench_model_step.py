"""Time one training step of a GMMFormer-family backbone on a synthetic TVR-shaped batch.

A step is forward + losses (triplet, InfoNCE on both branches, query-diverse)
+ backward + the trainer's optimiser (BertAdam with per-tensor clipping at
``--grad-clip``, as the configs; ``--optimizer foreach`` for its foreach form
instead of the one-pass kernel), data excluded; the reference figure for the official
GMMFormer on this kind of 2-core machine is 12.8 s (fp32, frames padded to 128).

    .venv/bin/python benchmarks/bench_model_step.py                 # fp32 and bf16, all 128 frames real
    .venv/bin/python benchmarks/bench_model_step.py --min-frames 32 # variable lengths (padding skipped)
    .venv/bin/python benchmarks/bench_model_step.py --backbone gmmformer_v2 --paths plain fast
                                                                    # attention paths side by side
    .venv/bin/python benchmarks/bench_model_step.py --backbone mssl --amp none \
        --variants frame_training=official,all_pairs                # values of one model key side by side

``--paths``: ``fast`` is GaussianAttention's fast paths (SDPA for plain
branches, float32 windowed products where bf16 is emulated, the fused CPU
kernel for the attention weights), ``unfused`` the same with the weights in
PyTorch passes, ``plain`` the plain path; they run alternately in the same
process, so their ratios hold under any machine load.  Ratios are printed as
min over min and as the median of the per-step pairs (step i of each runner
ran back to back): on a machine whose matrix units slow down and recover from
one minute to the next, the pairs are the steadier figure.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import resource
import statistics
import time
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from prvrlab.allocator import HOST_ALLOCATORS, set_host_allocator
from prvrlab.data.batch import Batch
from prvrlab.evaluation.retrieval import resolve_amp_dtype
from prvrlab.losses.weighted import WeightedLoss
from prvrlab.models.gmm import GaussianAttention
from prvrlab.models.native import kernel_threads
from prvrlab.models.precision import native_low_precision
from prvrlab.platform.train.optim import build_optimizer
from prvrlab.registry import BACKBONES
from prvrlab.reports.products import ProductTimer, product_lines

LOSSES = {
    "clip_trip": {"loss": "triplet", "weight": 1.0, "branch": "clip", "margin": 0.1},
    "frame_trip": {"loss": "triplet", "weight": 1.0, "branch": "frame", "margin": 0.1},
    "clip_nce": {"loss": "infonce", "weight": 0.02, "branch": "clip"},
    "frame_nce": {"loss": "infonce", "weight": 0.04, "branch": "frame"},
    "div": {"loss": "query_diverse", "weight": 8e-5, "branch": "clip", "alpha": 32.0, "delta": 0.2},
}


OFFICIAL_STEP_S = {"gmmformer": 12.8, "gmmformer_v2": 43.4}  # REFERENCE.md section 8, batch 128, fp32


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--videos", type=int, default=128, help="videos per batch")
    p.add_argument("--queries", type=int, default=640, help="queries per batch (spread evenly over the videos)")
    p.add_argument("--frames", type=int, default=128, help="padded frame length")
    p.add_argument("--min-frames", type=int, default=None, help="real frames drawn in [min, frames] (default: all)")
    p.add_argument("--clips", type=int, default=32)
    p.add_argument("--query-len", type=int, default=30, help="padded query length")
    p.add_argument("--min-query-len", type=int, default=8, help="real tokens drawn in [min, query-len]")
    p.add_argument("--video-dim", type=int, default=3072)
    p.add_argument("--query-dim", type=int, default=768)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="timed steps per precision")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per precision")
    p.add_argument("--amp", choices=["none", "bf16", "both"], default="both")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--grad-clip", type=float, default=1.0,
                   help="the optimiser's per-tensor clipping norm (the configs' train.grad_clip; 0: none)")
    p.add_argument("--optimizer", choices=["fused", "foreach"], default="fused",
                   help="BertAdam's one-pass kernel (prvrlab/models/adam_step.py) or its foreach form")
    p.add_argument("--backbone", default="gmmformer", help="a registered backbone (gmmformer, gmmformer_v2, ...)")
    p.add_argument("--paths", nargs="+", choices=["fast", "unfused", "plain"], default=["fast"],
                   help="attention paths to time side by side")
    p.add_argument("--model", action="append", default=[], metavar="KEY=VALUE",
                   help="a backbone hyperparameter (YAML value), repeatable")
    p.add_argument("--variants", metavar="KEY=V1,V2,...",
                   help="one runner per value of this backbone key, alternating with the others")
    p.add_argument("--products", type=int, default=0, metavar="N",
                   help="after the timed steps, one more step per runner with every matrix product timed: their share "
                        "of the step and the N (op, shapes) that lost the most time against the GEMM roof "
                        "(prvrlab/reports/products.py)")
    p.add_argument("--host-allocator", choices=list(HOST_ALLOCATORS), default="keep",
                   help="train.host_allocator of this process (benchmarks/bench_allocator.py compares them)")
    return p.parse_args()


def key_values(items: list[str]) -> dict[str, object]:
    """``KEY=VALUE`` strings -> a mapping, values read as YAML (``0.5``, ``true``, ``official``)."""
    import yaml

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--model takes KEY=VALUE, got {item!r}")
        out[key] = yaml.safe_load(value)
    return out


def synthetic_batch(args: argparse.Namespace, g: torch.Generator) -> Batch:
    """L2-normalised random features with random real lengths, zero padded."""
    B, Nq = args.videos, args.queries
    min_frames = args.frames if args.min_frames is None else args.min_frames
    frame_len = torch.randint(min_frames, args.frames + 1, (B,), generator=g)
    query_len = torch.randint(args.min_query_len, args.query_len + 1, (Nq,), generator=g)
    frame_mask = torch.arange(args.frames)[None] < frame_len[:, None]  # (B, Lf)
    query_mask = torch.arange(args.query_len)[None] < query_len[:, None]  # (Nq, Lq)
    frames = F.normalize(torch.randn(B, args.frames, args.video_dim, generator=g), dim=-1) * frame_mask[..., None]
    clips = F.normalize(torch.randn(B, args.clips, args.video_dim, generator=g), dim=-1)
    queries = F.normalize(torch.randn(Nq, args.query_len, args.query_dim, generator=g), dim=-1) * query_mask[..., None]
    query_video = torch.arange(Nq) * B // Nq  # contiguous, ~Nq/B queries per video
    return Batch(
        frames=frames,
        frame_mask=frame_mask,
        clips=clips,
        queries=queries,
        query_mask=query_mask,
        query_video=query_video,
        video_ids=[f"v{i}" for i in range(B)],
        query_ids=[f"q{i}" for i in range(Nq)],
    )


def gemm_roof(dtype: torch.dtype, repeats: int = 3) -> float:
    """GFLOP/s of an (M x 384) @ (384 x 4608) matmul, the shape of a GMMBlock's Q/K/V projection.

    M = 16384 (a batch's frames), or 1024 where the dtype is emulated (bf16 without native units runs at
    well under 1 GFLOP/s; the big product would take minutes)."""
    rows = 16384 if dtype == torch.float32 or native_low_precision("cpu") else 1024
    a = torch.randn(rows, 384, dtype=dtype)
    b = torch.randn(384, 4608, dtype=dtype)
    a @ b
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * rows * 384 * 4608 / best / 1e9


class Runner:
    """A model, its losses and the trainer's optimiser, trained on one batch under one precision."""

    def __init__(self, args: argparse.Namespace, amp: str, path: str = "fast", variant: tuple[str, object] | None = None) -> None:
        torch.manual_seed(args.seed)
        self.amp, self.path, self.variant = amp, path, variant
        self.name = f"{'fp32' if amp == 'none' else 'bf16 autocast'} {path}"
        if variant is not None:
            self.name += f" {variant[0]}={variant[1]}"
        sizes = {"hidden_size": args.hidden, "max_frames": max(args.frames, args.clips), "max_query_len": args.query_len}
        params = BACKBONES.params(args.backbone)
        chosen = {**{k: v for k, v in sizes.items() if k in params}, **key_values(args.model)}
        if variant is not None:
            chosen[variant[0]] = variant[1]
        self.model = BACKBONES.build(args.backbone, video_dim=args.video_dim, query_dim=args.query_dim, **chosen).train()
        self.criterion = WeightedLoss.from_config(LOSSES)
        self.optimizer, _ = build_optimizer(self.model, lr=3e-4, weight_decay=0.01, total_steps=1000,
                                            warmup_proportion=0.0, max_grad_norm=args.grad_clip,
                                            fused=args.optimizer == "fused")
        self.times: dict[str, list[float]] = {"forward": [], "losses": [], "backward": [], "optimiser": [], "step": []}

    def step(self, batch: Batch, record: bool) -> None:
        dtype = resolve_amp_dtype(self.amp)
        ctx = contextlib.nullcontext() if dtype is None else torch.autocast("cpu", dtype=dtype)
        GaussianAttention.fast = self.path != "plain"
        GaussianAttention.fused = self.path != "unfused"
        t0 = time.perf_counter()
        with ctx:
            out = self.model(batch)
            t1 = time.perf_counter()
            result = self.criterion(out, batch, epoch=0)
        t2 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        result.total.backward()
        GaussianAttention.fast = GaussianAttention.fused = True
        t3 = time.perf_counter()
        self.optimizer.step()
        t4 = time.perf_counter()
        if record:
            for key, value in zip(self.times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0)):
                self.times[key].append(value)


def paired(slow: list[float], fast: list[float]) -> str:
    """The median and range of the per-step ratios slow / fast: step i of every runner ran back to back,
    so on a machine whose speed drifts from minute to minute these pairs saw the same load."""
    ratios = sorted(a / b for a, b in zip(slow, fast))
    return f"median of the {len(ratios)} step pairs {statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f})"


def main() -> None:
    args = parse_args()
    set_host_allocator(args.host_allocator)
    torch.set_num_threads(args.threads)
    batch = synthetic_batch(args, torch.Generator().manual_seed(args.seed))
    real_frames = int(batch.frame_mask.sum())
    real_tokens = int(batch.query_mask.sum())
    print(
        f"batch: {args.videos} videos x {args.frames} frames ({real_frames / args.videos:.1f} real on average), "
        f"{args.clips} clips, {args.queries} queries x {args.query_len} tokens "
        f"({real_tokens / args.queries:.1f} real); dims {args.video_dim}/{args.query_dim} -> {args.hidden}; "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    roofs = {"none": gemm_roof(torch.float32), "bf16": gemm_roof(torch.bfloat16)}
    print(f"GEMM roof now: fp32 {roofs['none']:.1f} GFLOP/s, bf16 {roofs['bf16']:.1f} GFLOP/s")
    print(f"native bf16 matrix units on this CPU: {native_low_precision('cpu')}")
    print(f"this project's C++ kernels run on: {kernel_threads()}")
    amps = ["none", "bf16"] if args.amp == "both" else [args.amp]
    variants: list[tuple[str, object] | None] = [None]
    if args.variants:
        key, _, values = args.variants.partition("=")
        variants = [(key, key_values([f"{key}={v}"])[key]) for v in values.split(",")]
    runners = [Runner(args, amp, path, variant) for amp in amps for path in args.paths for variant in variants]
    counter = FlopCounterMode(display=False)
    with counter:  # one untimed step, counting the FLOPs of forward + losses + backward
        runners[0].step(batch, record=False)
    gflop = counter.get_total_flops() / 1e9
    counter = FlopCounterMode(display=False)
    with counter:  # the same with padding computed, as the reference code does
        runners[0].step(replace(batch, frame_mask=torch.ones_like(batch.frame_mask),
                                query_mask=torch.ones_like(batch.query_mask)), record=False)
    padded_gflop = counter.get_total_flops() / 1e9
    print(f"work per step: {gflop:.0f} GFLOP of matrix products ({padded_gflop:.0f} GFLOP if padding were computed)")
    for step in range(args.warmup + args.steps):  # runners interleaved: all see the same machine load
        for runner in runners:
            runner.step(batch, record=step >= args.warmup)
    per_step = {(r.amp, r.path): r.times["step"] for r in runners if r.variant is None or r.variant == variants[0]}
    best = {key: min(times) for key, times in per_step.items()}
    for runner in runners:
        t = runner.times
        parts = ", ".join(f"{k} {statistics.median(v):.2f}" for k, v in t.items() if k != "step")
        print(
            f"{runner.name:>18}: step min {min(t['step']):6.2f} s, "
            f"median {statistics.median(t['step']):6.2f} s ({parts}) = {args.videos / min(t['step']):.1f} videos/s, "
            f"{gflop / min(t['step']):.1f} GFLOP/s effective ({gflop / min(t['step']) / roofs[runner.amp]:.0%} "
            f"of the {'fp32' if runner.amp == 'none' else 'bf16'} GEMM roof)"
        )
    print(f"({args.steps} timed steps per runner after {args.warmup} warm-up; min = least disturbed by other load)")
    for path in args.paths:
        if ("none", path) in best and ("bf16", path) in best:
            print(f"bf16 speed-up over fp32 ({path}): {best[('none', path)] / best[('bf16', path)]:.2f}x "
                  f"(min over min); {paired(per_step[('none', path)], per_step[('bf16', path)])}")
    if args.variants:
        first = {(r.amp, r.path): min(r.times["step"]) for r in runners if r.variant == variants[0]}
        for runner in runners:
            if runner.variant != variants[0]:
                ratio = min(runner.times["step"]) / first[(runner.amp, runner.path)]
                print(f"{runner.name}: step {ratio:.2f}x that of {variants[0][0]}={variants[0][1]}")
    for other in ("plain", "unfused"):
        if other in args.paths and "fast" in args.paths:
            for amp in amps:
                print(f"fast over {other} attention ({'fp32' if amp == 'none' else 'bf16'}): "
                      f"{best[(amp, other)] / best[(amp, 'fast')]:.2f}x (min over min); "
                      f"{paired(per_step[(amp, other)], per_step[(amp, 'fast')])}")
    official = OFFICIAL_STEP_S.get(args.backbone)
    if official is not None and args.videos == 128:
        for key, value in best.items():
            print(f"{key[0]} {key[1]}: {official / value:.2f}x the official {args.backbone}'s {official} s/step "
                  "(the official code run unmodified on the same shapes, fp32, 2 threads, on a slower machine)")
    # The machine's speed varies (shared cores): compare with the fastest any fp32 implementation computing
    # padding (as the reference does) could be right now, i.e. that work at the fp32 GEMM roof.
    floor = padded_gflop / roofs["none"]
    for key, value in best.items():
        print(f"{key[0]} {key[1]}: {floor / value:.2f}x an ideal fp32 step computing padding at today's roof "
              f"({floor:.2f} s)")
    print(f"peak resident memory: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")
    if args.products > 0:
        for runner in runners:
            with ProductTimer() as timer:  # one more step, every matrix product timed (after the memory figure)
                runner.step(batch, record=False)
            print(f"{runner.name}:")
            lines = product_lines(list(timer.stats.values()), roofs[runner.amp], min(runner.times["step"]), args.products)
            print("\n".join(lines))


if __name__ == "__main__":
    main()
