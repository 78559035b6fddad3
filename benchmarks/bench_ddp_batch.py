"""What the global batch costs under DDP: training epochs of a config on 2 gloo ranks with
``train.ddp_batch: local`` (each rank's losses over its share) and ``global`` (the shares' encodings
gathered, every rank scoring the whole batch), alternating, in one run.

    python benchmarks/bench_ddp_batch.py                      # configs/gmmformer_synth.yaml, small preset
    python benchmarks/bench_ddp_batch.py --config configs/gmmformer_v2_synth.yaml --rounds 3

Prints each timed epoch's seconds per mode (rank 0's wall clock; the first epoch of each mode is a
warm-up) and the ratio of the medians, global / local.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from prvrlab.data.synth import synthesize
from prvrlab.platform.config import apply_overrides, load_raw, validate
from prvrlab.platform.train.loop import TrainingLoop
from prvrlab.platform.train.session import LocalSession

REPO = Path(__file__).resolve().parents[1]
WORLD = 2


def epochs(raw: dict, mode: str, out: Path, *, rank: int, rounds: int) -> list[float]:
    """Seconds of ``rounds`` timed epochs (after one warm-up epoch) with ``train.ddp_batch: mode`` on this rank."""
    cfg = validate(apply_overrides(raw, {"train.ddp_batch": mode}))
    session = LocalSession(out / mode / f"session{rank}")
    session.rank, session.world_size = rank, WORLD
    loop = TrainingLoop(cfg, session=session, run_dir=out / mode / "run")
    loop.setup()
    model = loop.wrap()
    times = []
    for epoch in range(rounds + 1):
        dist.barrier()
        start = time.perf_counter()
        _, failure = loop.train_epoch(epoch, model)
        if failure:
            raise RuntimeError(failure)
        dist.barrier()
        times.append(time.perf_counter() - start)
    return times[1:]


def _rank(rank: int, init: str, raw: dict, out: str, rounds: int, order: list[str], results: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=WORLD)
    try:
        got = {mode: [] for mode in order}
        for i, mode in enumerate(order):
            got[mode] += epochs(raw, mode, Path(out) / str(i), rank=rank, rounds=rounds)
        if rank == 0:
            torch.save(got, results)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(REPO / "configs" / "gmmformer_synth.yaml"))
    p.add_argument("--preset", default="small", help="synthetic collection preset")
    p.add_argument("--root", default="data/bench_ddp_batch", help="where the collection is written (once)")
    p.add_argument("--rounds", type=int, default=2, help="timed epochs per mode and pass")
    p.add_argument("--passes", type=int, default=2, help="local/global passes, alternating")
    args = p.parse_args()
    root = Path(args.root)
    if not (root / "synth.json").exists():
        synthesize(root, preset=args.preset, seed=0, progress=True)
    with tempfile.TemporaryDirectory() as tmp:
        raw = apply_overrides(load_raw(Path(args.config)), {
            "data.root": str(root), "data.synthesize": args.preset, "train.num_workers": WORLD, "train.torch_threads": 1,
            "tracking.uri": f"sqlite:///{tmp}/mlflow.db", "tracking.storage_path": f"{tmp}/results",
        })
        order = ["local", "global"] * args.passes
        results = f"{tmp}/results.pt"
        mp.spawn(_rank, args=(f"{tmp}/init", raw, tmp, args.rounds, order, results), nprocs=WORLD, join=True)
        got = torch.load(results)
    print(f"{Path(args.config).name} on the '{args.preset}' collection, {WORLD} gloo ranks x 1 thread")
    for mode, times in got.items():
        print(f"  ddp_batch {mode:6s}: epochs {', '.join(f'{t:.2f}' for t in times)} s (median {statistics.median(times):.2f})")
    ratio = statistics.median(got["global"]) / statistics.median(got["local"])
    print(f"  global / local: {ratio:.2f}x the epoch time")


if __name__ == "__main__":
    main()
