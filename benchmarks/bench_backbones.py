"""Compare the backbones: training step time, retrieval latency per query, parameters and FLOPs.

For each backbone (MS-SL, GMMFormer, GMMFormer v2, the ICE base model, MamFusion) with
TVR's dimensions (3,072-d frames, 768-d query tokens, hidden 384):

* training step (forward + the backbone's paper losses + backward + AdamW,
  data excluded) on a synthetic batch of 128 videos / 640 queries, fp32 and
  bf16 autocast (as benchmarks/bench_model_step.py);
* retrieval latency per query against galleries of 500 ... 2,500 videos
  encoded offline (the setting of GMMFormer v2's Table 2 and MS-SL /
  GMMFormer's efficiency tables): the time to encode one query and score it
  against the whole gallery (``fuse(score(...))``), median over single
  queries, plus the amortised time per query when 100 are scored at once;
* parameters, the gallery's size in memory (float32 embeddings of 2,500
  videos), FLOPs per query (query encoding + scoring 2,500 videos) and per
  video encoded offline (``torch.utils.flop_counter``: matrix products only).

    .venv/bin/python benchmarks/bench_backbones.py                       # everything (long on 2 CPU cores)
    .venv/bin/python benchmarks/bench_backbones.py --steps 1 --warmup 0  # quick
    .venv/bin/python benchmarks/bench_backbones.py --skip-train --models mssl gmmformer_v2
"""

from __future__ import annotations

import argparse
import contextlib
import math
import resource
import statistics
import time

import torch
from bench_model_step import synthetic_batch
from torch.utils.flop_counter import FlopCounterMode

from prvrlab.data.batch import Batch
from prvrlab.evaluation.retrieval import resolve_amp_dtype
from prvrlab.losses.weighted import WeightedLoss
from prvrlab.models.base import RetrievalModel, VideoEmbedding
from prvrlab.registry import BACKBONES
from prvrlab.evaluation.profile import DEFAULT_GALLERIES


def _base_losses(first: str, second: str, margin: float, nce: tuple[float, float]) -> dict:
    return {
        f"{first}_trip": {"loss": "triplet", "weight": 1.0, "branch": first, "margin": margin},
        f"{second}_trip": {"loss": "triplet", "weight": 1.0, "branch": second, "margin": margin},
        f"{first}_nce": {"loss": "infonce", "weight": nce[0], "branch": first},
        f"{second}_nce": {"loss": "infonce", "weight": nce[1], "branch": second},
    }


# Each backbone with its TVR settings and loss terms (configs/<name>_tvr.yaml).
SETUPS: dict[str, tuple[dict, dict]] = {
    "mssl": ({}, _base_losses("clip", "frame", 0.1, (0.02, 0.04))),
    "gmmformer": (
        {},
        {
            **_base_losses("clip", "frame", 0.1, (0.02, 0.04)),
            "div": {"loss": "query_diverse", "weight": 8e-5, "branch": "clip", "alpha": 32.0, "delta": 0.2},
        },
    ),
    "gmmformer_v2": (
        {"tau": 0.09},
        {
            **_base_losses("clip", "frame", 0.1, (0.05, 0.04)),
            "div": {"loss": "query_diverse_focal", "weight": 8e-5, "branch": "clip", "delta": 0.15, "gamma": 1.0},
            "om": {"loss": "optimal_matching", "weight": 0.09, "branch": "clip"},
        },
    ),
    "ice_base": ({}, _base_losses("moment", "video", 0.1, (0.04, 0.02))),
    "mamfusion": (  # the reference's batch fusion: the fused sentence vector feeds the query-diverse loss
        {},
        {
            **_base_losses("clip", "frame", 0.2, (0.027, 0.045)),
            "div": {"loss": "query_diverse", "weight": 0.015, "branch": "fused", "alpha": 32.0, "delta": 0.2},
        },
    ),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    p.add_argument("--videos", type=int, default=128, help="videos per training batch")
    p.add_argument("--queries", type=int, default=640, help="queries per training batch")
    p.add_argument("--frames", type=int, default=128, help="padded frame length")
    p.add_argument("--min-frames", type=int, default=None, help="real frames drawn in [min, frames] (default: all)")
    p.add_argument("--clips", type=int, default=32)
    p.add_argument("--query-len", type=int, default=30)
    p.add_argument("--min-query-len", type=int, default=8)
    p.add_argument("--video-dim", type=int, default=3072)
    p.add_argument("--query-dim", type=int, default=768)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=2, help="timed training steps per precision")
    p.add_argument("--warmup", type=int, default=1, help="untimed training steps per precision")
    p.add_argument("--amp", choices=["none", "bf16", "both"], default="both")
    p.add_argument("--skip-train", action="store_true")
    p.add_argument("--galleries", type=int, nargs="+", default=list(DEFAULT_GALLERIES))
    p.add_argument("--encode-videos", type=int, default=256,
                   help="distinct videos encoded for the gallery (tiled up to the largest: cost is content-free)")
    p.add_argument("--latency-queries", type=int, default=20, help="single queries timed per gallery size")
    p.add_argument("--query-batch", type=int, default=100, help="queries scored at once for the amortised figure")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def autocast(device: torch.device, amp: str):
    dtype = resolve_amp_dtype(amp)
    return contextlib.nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


def build(name: str, args: argparse.Namespace) -> RetrievalModel:
    torch.manual_seed(args.seed)
    kwargs, _ = SETUPS[name]
    return BACKBONES.build(
        name, video_dim=args.video_dim, query_dim=args.query_dim, hidden_size=args.hidden,
        max_frames=max(args.frames, args.clips), max_query_len=args.query_len, **kwargs,
    )


# ---------------------------------------------------------------- training step


def train_step(model, criterion, optimizer, batch: Batch, amp: str, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    with autocast(device, amp):
        out = model(batch)
        result = criterion(out, batch, epoch=0)
    optimizer.zero_grad(set_to_none=True)
    result.total.backward()
    optimizer.step()
    sync(device)
    return time.perf_counter() - t0


def bench_training(names: list[str], args: argparse.Namespace, batch: Batch, device: torch.device) -> dict:
    """Min step time per (backbone, precision), all interleaved so that each sees the same machine load."""
    amps = ["none", "bf16"] if args.amp == "both" else [args.amp]
    runners = {}
    results: dict[str, dict] = {}
    for name in names:
        for amp in amps:
            model = build(name, args).to(device).train()
            criterion = WeightedLoss.from_config(SETUPS[name][1])
            optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
            runners[name, amp] = (model, criterion, optimizer)
        model, criterion, optimizer = runners[name, amps[0]]
        counter = FlopCounterMode(display=False)
        with counter:  # untimed, also a first warm-up step of that precision
            train_step(model, criterion, optimizer, batch, amps[0], device)
        results[name] = {"gflop_step": counter.get_total_flops() / 1e9}
    times: dict[tuple[str, str], list[float]] = {key: [] for key in runners}
    for step in range(args.warmup + args.steps):
        for key, (model, criterion, optimizer) in runners.items():
            t = train_step(model, criterion, optimizer, batch, key[1], device)
            if step >= args.warmup:
                times[key].append(t)
        print(f"  training step {step + 1}/{args.warmup + args.steps} done", flush=True)
    for (name, amp), t in times.items():
        results[name][amp] = min(t)
    return results


# ---------------------------------------------------------------- retrieval


def random_videos(n: int, args: argparse.Namespace, g: torch.Generator, device: torch.device):
    min_frames = args.frames if args.min_frames is None else args.min_frames
    lengths = torch.randint(min_frames, args.frames + 1, (n,), generator=g)
    mask = torch.arange(args.frames)[None] < lengths[:, None]
    frames = torch.nn.functional.normalize(torch.randn(n, args.frames, args.video_dim, generator=g), dim=-1)
    clips = torch.nn.functional.normalize(torch.randn(n, args.clips, args.video_dim, generator=g), dim=-1)
    return clips.to(device), (frames * mask[..., None]).to(device), mask.to(device)


def random_queries(n: int, args: argparse.Namespace, g: torch.Generator, device: torch.device):
    lengths = torch.randint(args.min_query_len, args.query_len + 1, (n,), generator=g)
    mask = torch.arange(args.query_len)[None] < lengths[:, None]
    tokens = torch.nn.functional.normalize(torch.randn(n, args.query_len, args.query_dim, generator=g), dim=-1)
    return (tokens * mask[..., None]).to(device), mask.to(device)


def embedding_bytes(emb: VideoEmbedding) -> int:
    total = 0
    for t in (emb.clip, emb.frame, emb.frame_mask, *emb.extra.values()):
        if t is not None:
            total += t.numel() * t.element_size()
    return total


def encode_gallery(
    model: RetrievalModel, args: argparse.Namespace, device: torch.device
) -> tuple[VideoEmbedding, float]:
    """The largest gallery (``--encode-videos`` distinct videos, tiled) and the GFLOP of encoding one video."""
    g = torch.Generator().manual_seed(args.seed + 1)
    largest = max(args.galleries)
    distinct = min(args.encode_videos, largest)
    parts = []
    with torch.inference_mode():
        for start in range(0, distinct, 64):  # encoded offline (bf16 for speed; stored as float32)
            clips, frames, mask = random_videos(min(64, distinct - start), args, g, device)
            with autocast(device, "bf16"):
                parts.append(model.encode_videos(clips, frames, mask))
        base = VideoEmbedding.cat(parts)
        base = VideoEmbedding(
            clip=base.clip.float(), frame=base.frame.float(), frame_mask=base.frame_mask,
            extra={k: v.float() for k, v in base.extra.items()},
        )
        gallery = base.index(torch.arange(largest, device=device) % distinct)  # (largest, ...)
        clips, frames, mask = random_videos(1, args, g, device)
        counter = FlopCounterMode(display=False)
        with counter:
            model.encode_videos(clips, frames, mask)
    return gallery, counter.get_total_flops() / 1e9


def time_queries(model, emb, queries, qmask, device) -> float:
    """Seconds to encode ``queries`` and score them against ``emb``."""
    sync(device)
    t0 = time.perf_counter()
    q = model.encode_queries(queries, qmask)
    scores = model.fuse(model.score(q, emb))  # (n, Nv)
    sync(device)
    assert scores.shape == (queries.shape[0], emb.clip.shape[0])
    return time.perf_counter() - t0


def bench_retrieval(names: list[str], args: argparse.Namespace, device: torch.device) -> dict:
    """Latency per query for every backbone and gallery size, interleaved (min over repetitions)."""
    models = {name: build(name, args).to(device).eval() for name in names}
    results: dict[str, dict] = {}
    galleries = {}
    for name, model in models.items():
        galleries[name], video_gflop = encode_gallery(model, args, device)
        results[name] = {"video_gflop": video_gflop, "latency_ms": {}, "latency_median_ms": {}, "amortised_ms": {},
                         "params_m": sum(p.numel() for p in model.parameters()) / 1e6}
    g = torch.Generator().manual_seed(args.seed + 2)
    queries, qmask = random_queries(max(args.latency_queries, args.query_batch), args, g, device)
    with torch.inference_mode():
        for size in sorted(args.galleries):
            views = {name: galleries[name].index(slice(0, size)) for name in names}
            single: dict[str, list[float]] = {name: [] for name in names}
            batched: dict[str, list[float]] = {name: [] for name in names}
            for name in names:  # warm-up: first touch of the gallery view
                time_queries(models[name], views[name], queries[:1], qmask[:1], device)
            for i in range(args.latency_queries):
                for name in names:
                    one = (queries[i : i + 1], qmask[i : i + 1])
                    single[name].append(time_queries(models[name], views[name], *one, device))
            for _ in range(3):
                for name in names:
                    many = (queries[: args.query_batch], qmask[: args.query_batch])
                    t = time_queries(models[name], views[name], *many, device)
                    batched[name].append(t / args.query_batch)
            for name in names:
                results[name]["latency_ms"][size] = 1e3 * min(single[name])
                results[name]["latency_median_ms"][size] = 1e3 * statistics.median(single[name])
                results[name]["amortised_ms"][size] = 1e3 * min(batched[name])
            print(f"  gallery {size} done", flush=True)
        largest = max(args.galleries)
        for name, model in models.items():
            emb = galleries[name]
            counter = FlopCounterMode(display=False)
            with counter:
                q = model.encode_queries(queries[:1], qmask[:1])
                model.fuse(model.score(q, emb))
            results[name]["query_gflop"] = counter.get_total_flops() / 1e9
            results[name]["gallery_mib"] = embedding_bytes(emb) / 2**20
            results[name]["largest"] = largest
    return results


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(
        f"TVR dims {args.video_dim}/{args.query_dim} -> {args.hidden}; frames {args.frames} "
        f"({'all real' if args.min_frames is None else f'{args.min_frames}..{args.frames} real'}), {args.clips} clips; "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}, device {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
    )
    batch = None
    if not args.skip_train:
        batch = synthetic_batch(args, torch.Generator().manual_seed(args.seed)).to(device)
    t0 = time.perf_counter()
    rows = bench_retrieval(args.models, args, device)
    print(f"  retrieval measured in {time.perf_counter() - t0:.0f} s", flush=True)
    if batch is not None:
        t0 = time.perf_counter()
        for name, train in bench_training(args.models, args, batch, device).items():
            rows[name]["train"] = train
        print(f"  training measured in {time.perf_counter() - t0:.0f} s", flush=True)
    print()
    if batch is not None:
        print(f"Training step ({args.videos} videos / {args.queries} queries, forward + losses + backward + AdamW; "
              f"min of {args.steps} after {args.warmup} warm-up; backbones and precisions interleaved)")
        print(f"{'backbone':<14}{'fp32 s':>9}{'bf16 s':>9}{'videos/s fp32':>15}{'videos/s bf16':>15}{'GFLOP/step':>12}")
        for name, row in rows.items():
            t = row["train"]
            fp32, bf16 = t.get("none", math.nan), t.get("bf16", math.nan)
            print(f"{name:<14}{fp32:>9.2f}{bf16:>9.2f}{args.videos / fp32:>15.1f}{args.videos / bf16:>15.1f}"
                  f"{t['gflop_step']:>12.0f}")
        print()
    sizes = sorted(args.galleries)
    print(f"Retrieval latency per query, ms (encode 1 query + score the gallery; min [median] of "
          f"{args.latency_queries} single queries; amortised: min of 3 batches of {args.query_batch} queries, "
          f"divided by {args.query_batch})")
    print(f"{'backbone':<14}{'':<10}" + "".join(f"{s:>10}" for s in sizes))
    for name, row in rows.items():
        print(f"{name:<14}{'single':<10}" + "".join(f"{row['latency_ms'][s]:>10.2f}" for s in sizes))
        print(f"{'':<14}{'[median]':<10}" + "".join(f"{row['latency_median_ms'][s]:>10.2f}" for s in sizes))
        print(f"{'':<14}{'amortised':<10}" + "".join(f"{row['amortised_ms'][s]:>10.2f}" for s in sizes))
    print()
    largest = max(sizes)
    print(f"{'backbone':<14}{'params (M)':>11}{'GFLOP/query':>13}{'GFLOP/video':>13}{f'gallery MiB @{largest}':>20}")
    for name, row in rows.items():
        print(f"{name:<14}{row['params_m']:>11.2f}{row['query_gflop']:>13.3f}{row['video_gflop']:>13.3f}"
              f"{row['gallery_mib']:>20.0f}")
    print("(GFLOP/query: query encoding + scoring against the whole gallery; GFLOP/video: encoding one video "
          "offline; matrix products only)")
    print(f"peak resident memory of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.1f} GiB")


if __name__ == "__main__":
    main()
