"""The cost of ARL (paper 001): the per-epoch dataset-wide uncertainty and the training step.

1. The uncertainty reduction (Eq. 4) at TVR scale -- 87,175 queries, 17,435
   videos of up to 128 frames, d = 384 -- on random unit vectors standing in
   for the encoded training split: the exact mean-vector reduction
   (``reduce_uncertainty``, one rank: two GEMVs per batch of frames and one
   ``index_add_``), wall and CPU seconds, against two same-run baselines: the
   same algebra with every video padded to 128 frames in float64, and the
   naive N_q x N_v x L_v map (timed on a slice of the queries, extrapolated).
   The encoding pass is not included here (2.).
2. The epoch-start pass with encoding (``ARL.dataset_uncertainty``) of the
   ``arl`` backbone on a TVR-shaped synthetic collection (--train-videos),
   per video, extrapolated to TVR's 17,435 training videos.
3. Seconds per training step (forward, losses, backward, optimiser; data
   excluded) of configs/arl_tvr.yaml on that collection: the base model (every
   ARL switch off), ARL with one encoder and ARL with cross-model detection,
   each after an epoch-start pass so that detection is on.

    .venv/bin/python benchmarks/bench_arl.py --train-videos 256 --batch-size 32 --steps 2
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from _common import bench_system, machine, peak_rss_gib, step_seconds, tvr_bench_collection, tvr_config
from prvrlab.data.collection import open_collection
from prvrlab.data.dataset import train_loader
from prvrlab.models.component import EpochContext
from prvrlab.models.plugins.arl import _Encoded, reduce_uncertainty

TVR_QUERIES, TVR_VIDEOS, TVR_FRAMES, DIM = 87_175, 17_435, 128, 384


def context(model, device: torch.device, batches=lambda: iter(())) -> EpochContext:
    return EpochContext(epoch=10, num_epochs=11, model=model, device=device, amp_dtype=None, rank=0, world_size=1,
                        train_batches=batches)


def reduction_at_tvr_scale(batch_videos: int, naive_queries: int) -> None:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(TVR_FRAMES // 4, TVR_FRAMES + 1, (TVR_VIDEOS,), generator=g)  # (N_v,)
    per_video = torch.full((TVR_VIDEOS,), TVR_QUERIES // TVR_VIDEOS)
    per_video[: TVR_QUERIES - int(per_video.sum())] += 1
    enc = _Encoded([], [], [])
    slots, query_ids, video_ids = [], [], []
    for start in range(0, TVR_VIDEOS, batch_videos):
        lens = lengths[start : start + batch_videos]
        nq, nf = int(per_video[start : start + batch_videos].sum()), int(lens.sum())
        enc.queries.append(F.normalize(torch.randn(nq, DIM, generator=g), dim=-1))
        enc.frames.append(F.normalize(torch.randn(nf, DIM, generator=g), dim=-1))
        enc.positive.append(torch.rand(nq, generator=g))
        video = torch.repeat_interleave(torch.arange(len(lens)), lens) + len(video_ids)
        slots.append((video, torch.cat([torch.arange(int(n)) for n in lens])))
        query_ids += [f"q{len(query_ids) + i}" for i in range(nq)]
        video_ids += [f"v{start + i}" for i in range(len(lens))]
    total_frames = int(lengths.sum())
    ctx = context(None, torch.device("cpu"))
    fast, fast_cpu = timed(lambda: reduce_uncertainty(ctx, [enc], query_ids, video_ids, slots, (None, None)))
    padded, padded_cpu = timed(lambda: padded_reduction(enc, lengths, batch_videos), repeats=1)
    (table,), (query_unc, frame_unc) = reduce_uncertainty(ctx, [enc], query_ids, video_ids, slots, (None, None)), \
        padded_reduction(enc, lengths, batch_videos)
    torch.testing.assert_close(table.query.double(), query_unc, atol=1e-5, rtol=0)  # the baseline computes the same
    torch.testing.assert_close(table.frame.double(), frame_unc, atol=1e-5, rtol=0)
    queries = torch.cat(enc.queries)[:naive_queries]  # (n, D)
    frames = torch.cat(enc.frames)  # (sum L, D)
    t0 = time.perf_counter()
    for start in range(0, naive_queries, 64):  # the map M, 64 query rows at a time
        m = queries[start : start + 64] @ frames.t()  # (64, sum L)
        m.mean(dim=1), m.sum(dim=0)
    naive = (time.perf_counter() - t0) * TVR_QUERIES / naive_queries
    print(f"uncertainty reduction at TVR scale ({TVR_QUERIES:,} queries, {TVR_VIDEOS:,} videos, "
          f"{total_frames:,} frames, d={DIM}), best of 3; goal < 1 s (CPU time is what a shared machine cannot inflate):")
    print(f"  reduce_uncertainty (GEMVs + index_add_)     {fast:7.3f} s wall  {fast_cpu:7.3f} s CPU")
    print(f"  baseline: padded to {TVR_FRAMES} frames, float64  {padded:7.3f} s wall  {padded_cpu:7.3f} s CPU  "
          f"-> x{padded / fast:.1f} wall, x{padded_cpu / fast_cpu:.1f} CPU")
    print(f"  baseline: the N_q x sum(L_v) map M {naive:10,.0f} s wall (extrapolated from {naive_queries} queries) "
          f"-> x{naive / fast:,.0f};  peak RSS {peak_rss_gib():.2f} GiB")


def timed(fn, repeats: int = 3) -> tuple[float, float]:
    """Best wall and best CPU seconds (this process) of ``repeats`` calls."""
    walls, cpus = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return min(walls), min(cpus)


def padded_reduction(enc: _Encoded, lengths: torch.Tensor, batch_videos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Same-run baseline: the same mean-vector algebra the straightforward way -- every batch's videos padded
    to the full frame count, float64, masked sums -- as the reduction must not do it."""
    queries = torch.cat(enc.queries).double()  # (N_q, D) copy
    mean_q = queries.mean(dim=0)  # (D,)
    frame_unc, frame_sum, count = [], torch.zeros(DIM, dtype=torch.float64), 0
    for b, f in enumerate(enc.frames):
        lens = lengths[b * batch_videos : (b + 1) * batch_videos]
        mask = torch.arange(TVR_FRAMES)[None] < lens[:, None]  # (B, L)
        padded = torch.zeros(len(lens), TVR_FRAMES, DIM, dtype=torch.float64)  # (B, L, D)
        padded[mask] = f.double()
        frame_unc.append(padded @ mean_q)  # (B, L)
        frame_sum += (padded * mask[..., None]).sum(dim=(0, 1))
        count += int(mask.sum())
    return queries @ (frame_sum / count), torch.cat(frame_unc)  # (N_q,), (N_v, L)




def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default="data/bench_tvr_arl")
    p.add_argument("--train-videos", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--amp", default="bf16", choices=["none", "bf16"])
    p.add_argument("--naive-queries", type=int, default=256)
    p.add_argument("--skip-training", action="store_true", help="only the reduction at TVR scale")
    p.add_argument("--skip-reduction", action="store_true", help="only the epoch-start pass and the steps")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"machine: {machine()}")
    if not args.skip_reduction:
        reduction_at_tvr_scale(128, args.naive_queries)
    if args.skip_training:
        return

    root = tvr_bench_collection(Path(args.root), args.train_videos, 64, 64)
    variants = {
        "base (ARL off)": {"plugins.arl.text_video": False, "plugins.arl.text_frame": False, "plugins.arl.cross_model": False},
        "ARL, one encoder": {"plugins.arl.cross_model": False},
        "ARL, cross-model": {},
    }
    baseline = None
    for name, extra in variants.items():
        cfg = tvr_config(root, "arl_tvr.yaml", **{"plugins.arl.warmup_epochs": 0, **extra})
        collection = open_collection(cfg.data)
        system = bench_system(cfg, collection)
        plugin = system.model.plugins["arl"]

        def batches():
            loader, _ = train_loader(collection, "train", batch_size_per_rank=args.batch_size, shuffle=False)
            return iter(loader)

        t0 = time.perf_counter()
        plugin.on_epoch_start(context(system.model, torch.device("cpu"), batches))
        epoch_start = time.perf_counter() - t0
        seconds = step_seconds(system, collection, batch_size=args.batch_size, steps=args.steps, amp=args.amp, epoch=10)
        baseline = baseline or seconds
        per_video = epoch_start / collection.split("train").num_videos
        print(f"{name:<18} step ({args.amp}, {args.batch_size} videos) {seconds:6.2f} s  x{seconds / baseline:4.2f}   "
              f"epoch-start pass {epoch_start:6.2f} s = {per_video * 1e3:5.1f} ms/video "
              f"(~{per_video * TVR_VIDEOS:,.0f} s for TVR's {TVR_VIDEOS:,})   peak RSS {peak_rss_gib():.2f} GiB")


if __name__ == "__main__":
    main()
