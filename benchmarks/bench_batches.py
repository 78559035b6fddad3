"""How fast training batches reach the device: the streamed loader against a resident split (``data.resident``).

On the TVR-shaped synthetic collection (the one bench_eval.py and
bench_inprocess.py use), delivers every batch of the training split (batch
128 videos, 5 queries each) onto ``--device`` and waits for it there, first
through the platform's loader (``--loader-workers`` processes; batches
page-locked on CUDA, as ``data.pin_memory`` does by default), then from a
:class:`~prvrlab.data.resident.ResidentSplit` on that device. Prints seconds
per batch of each (median over the epochs after the first), their ratio
against the same run's loader, the resident split's size and load time, and
checks on one batch that both ways give the same values. No model runs: compare
the figures with a model step of the same device (bench_backbones.py).

    .venv/bin/python benchmarks/bench_batches.py --train-videos 512 --epochs 3
    python3 benchmarks/bench_batches.py --device cuda --loader-workers 4 8   # on a GPU
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from _common import add_collection_options, bench_collection, machine, peak_rss_gib, tvr_config
from prvrlab.data.collection import open_collection
from prvrlab.data.dataset import train_loader
from prvrlab.data.resident import ResidentSplit


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def epoch_seconds(loader, sampler, device: torch.device, epochs: int) -> list[float]:
    """Seconds per batch of each epoch: every batch moved onto ``device`` and waited for."""
    out = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        _sync(device)
        t0 = time.perf_counter()
        n = 0
        for batch in loader:
            batch.to(device, non_blocking=True)
            n += 1
        _sync(device)
        out.append((time.perf_counter() - t0) / n)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_collection_options(p)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--epochs", type=int, default=3, help="passes over the split per way (the first is a warm-up)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--loader-workers", type=int, nargs="+", default=[1])
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    root = bench_collection(args)
    collection = open_collection(tvr_config(root).data)
    print(f"machine: {machine()}")
    if device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(device)}")
    kwargs = dict(batch_size_per_rank=args.batch, seed=0)
    rows = []
    for workers in args.loader_workers:
        loader, sampler = train_loader(collection, "train", num_workers=workers, pin_memory=device.type == "cuda", **kwargs)
        times = epoch_seconds(loader, sampler, device, args.epochs)
        rows.append((f"loader, {workers} workers", statistics.median(times[1:] or times)))
        del loader
    t0 = time.perf_counter()
    held = ResidentSplit(collection, "train", device=device, num_workers=max(args.loader_workers))
    _sync(device)
    load_s = time.perf_counter() - t0
    made, sampler = train_loader(collection, "train", resident=held, **kwargs)
    times = epoch_seconds(made, sampler, device, args.epochs)
    rows.append(("resident", statistics.median(times[1:] or times)))

    streamed, _ = train_loader(collection, "train", shuffle=False, **kwargs)  # first batch: videos 0 .. batch-1
    first = next(iter(streamed))
    same = all(torch.equal(getattr(first, k), getattr(held.batch(list(range(len(first.video_ids)))), k).cpu())
               for k in ("frames", "frame_mask", "clips", "queries", "query_mask", "query_video"))

    print(f"{args.train_videos} training videos, batch {args.batch}, {args.epochs} epochs per way, {device}")
    print(f"resident split: {held.nbytes / 2**30:.2f} GiB, loaded in {load_s:.1f} s "
          f"({max(args.loader_workers)} workers); first batch equal to the loader's: {same}")
    base = rows[0][1]
    print(f"{'way':<22} {'ms/batch':>9} {'x loader':>9}")
    for name, s in rows:
        print(f"{name:<22} {s * 1000:9.1f} {base / s:9.1f}")
    memory = f"peak GPU memory {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB" if device.type == "cuda" else ""
    print(f"peak RSS {peak_rss_gib():.2f} GiB {memory}".strip())


if __name__ == "__main__":
    main()
