"""Evaluation time and peak memory at TVR scale, against a naive baseline in the same run.

Evaluates an (untrained) GMMFormer of configs/gmmformer_tvr.yaml on a
TVR-shaped synthetic collection:

- `val`: 500 videos x 2,500 queries, the setting of REFERENCE.md §8 / issue 16,
  which recorded 21.5 s for the official GMMFormer (34.4 s for v2; fp32, a quiet
  machine); same-run official times on later hosts were 14.7-24 s, so only
  ``--official-src`` (the official code run alternately here) gives a same-run ratio;
- `test`: TVR's full test size, 2,179 videos x 10,895 queries.

Two paths run alternately (best of ``--repeats``), so their ratio holds under
any machine load:

- ``naive``: the evaluation before issue 16 (videos in split order, so every
  batch pads to its longest video; the plain attention path; one process);
- ``fast``: :func:`prvrlab.evaluation.retrieval.evaluate` (videos by length,
  the fast attention paths, bf16 falling back to float32 on CPUs without
  native bf16 units).

Prints loading+encoding of videos, encoding of queries, scoring+ranking,
total, the fast/naive ratio, the ratio to the recorded official figure (which
was taken on a quiet machine: read it with the load printed beside it), and
peak resident memory of one evaluation per path, each measured in a fresh
process (``--peak-of``), so neither the collection's synthesis nor the other
path's evaluation counts; the official code holds 1.7-2.2 GB at 2,500 x 500
(issue 16).  ``--phase-peaks`` adds, per fresh-process evaluation, the resident set at the start,
peak and end of its video, query and scoring phases (Linux: the kernel's peak is reset at each phase,
``/proc/self/clear_refs``).  DDP sharding is not timed here (one process); its
equality is tested in tests/evaluation/test_eval_sharding.py.

    .venv/bin/python benchmarks/bench_eval.py
    .venv/bin/python benchmarks/bench_eval.py --val-videos 200 --splits val --amp none   # a quick look
    .venv/bin/python benchmarks/bench_eval.py --splits test --amp bf16 --no-naive --phase-peaks   # where the peak is
    python3 benchmarks/bench_eval.py --device cuda --splits test --no-memory            # on a GPU (prints peak GPU memory)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time

import torch

from _common import (
    add_collection_options, add_host_allocator_option, bench_collection, host_probe, machine, peak_rss_gib,
    reset_peak_rss, status_gib, tvr_config,
)
from prvrlab.allocator import primitive_cache_limit, set_host_allocator
from prvrlab.data.collection import open_collection
from prvrlab.data.dataset import query_batches, video_batches
from prvrlab.evaluation import retrieval
from prvrlab.evaluation.retrieval import EvalResult, evaluate, evaluate_batches
from prvrlab.models.native import kernel_threads
from prvrlab.models.precision import native_low_precision
from prvrlab.models.factory import build_model
from prvrlab.models.gmm import GaussianAttention
from prvrlab.platform.train.loop import seed_everything

OFFICIAL_S = {"gmmformer": 21.5, "gmmformer_v2": 34.4}  # issue 16: 2,500 queries x 500 videos, quiet machine, fp32


def naive(model, collection, split: str, eval_cfg, amp: str, device: str = "cpu") -> EvalResult:
    """The evaluation before issue 16: split order, batches padded to their longest video, the plain
    attention path."""
    index = collection.split(split)
    GaussianAttention.fast = False
    try:
        return evaluate_batches(
            model,
            video_batches(collection, split, eval_cfg.video_batch_size),
            query_batches(collection, split, eval_cfg.query_batch_size),
            video_ids=index.video_ids, query_ids=index.query_ids, query_video=index.query_video,
            ratios=getattr(index, "ratios", None), chunk=int(eval_cfg.score_chunk), amp_dtype=amp, device=device,
        )
    finally:
        GaussianAttention.fast = True


PHASES = ("encode_videos", "encode_queries", "compute_ranks")  # functions of prvrlab.evaluation.retrieval


class PhasePeaks:
    """Resident set (GiB) at the start, peak and end of each evaluation phase: the kernel's peak (VmHWM)
    is read, folded into the process's overall peak, and reset to the current RSS at each phase's start
    and end (``/proc/self/clear_refs``)."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, float, float, float]] = []
        self.overall = 0.0

    def _reset(self) -> float:
        hwm = peak_rss_gib()
        self.overall = max(self.overall, hwm)
        reset_peak_rss()
        return hwm

    def wrap(self, module, name: str) -> None:
        run = getattr(module, name)

        def measured(*a, **k):
            self._reset()
            start = status_gib("VmRSS")
            out = run(*a, **k)
            self.rows.append((name, start, self._reset(), status_gib("VmRSS")))
            return out

        setattr(module, name, measured)

    def peak(self) -> float:
        """The process's peak so far, across the resets."""
        return max(self.overall, peak_rss_gib())


def peak_of(args, path: str, split: str, amp: str) -> tuple[float, float, float, list[str]]:
    """(RSS before the evaluation, peak RSS) in GiB, the seconds of one ``path`` evaluation in a fresh
    process (the process's first: nothing warmed up) and, with ``--phase-peaks``, its phase lines."""
    cmd = [sys.executable, __file__, "--root", args.root, "--config", args.config, "--threads", str(args.threads),
           "--train-videos", str(args.train_videos), "--val-videos", str(args.val_videos),
           "--host-allocator", args.host_allocator,
           "--test-videos", str(args.test_videos), "--peak-of", path, "--splits", split, "--amp", amp,
           *([] if args.video_batch is None else ["--video-batch", str(args.video_batch)]),
           *([] if args.window_length is None else ["--window-length", args.window_length]),
           *(["--phase-peaks"] if args.phase_peaks else [])]
    lines = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()
    out = lines[-1].split()
    return float(out[-3]), float(out[-2]), float(out[-1]), [line for line in lines if line.startswith("phase ")]


def run_official(args, split: str) -> dict:
    """One run of the official evaluation (``official_eval.py``, a fresh process) on ``split``: its figures."""
    cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "official_eval.py"),
           "--src", args.official_src, "--root", args.root, "--split", split, "--threads", str(args.threads),
           "--json", *([] if args.official_site is None else ["--site", args.official_site])]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()
    return json.loads(out[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_collection_options(p)
    p.add_argument("--config", default="gmmformer_tvr.yaml")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="cpu or cuda (peak-RSS runs are CPU-only; on cuda: peak GPU memory)")
    p.add_argument("--splits", nargs="+", default=["val", "test"])
    p.add_argument("--amp", nargs="+", default=["none", "bf16"], choices=["none", "bf16"])
    p.add_argument("--repeats", type=int, default=1, help="alternating runs per path (best kept)")
    p.add_argument("--no-naive", action="store_true", help="skip the naive baseline")
    p.add_argument("--video-batch", type=int, help="eval.video_batch_size (default: the config's)")
    p.add_argument("--window-length", choices=["padded", "batch", "real"],
                   help="model.window_length (default: the config's; GMMFormer's and MamFusion's dataset configs say "
                        "batch since 2026-12-05: videos are then evaluated in split order, video_batch_size at a time, "
                        "as the official code does; the figures before were taken with padded)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-RSS runs in fresh processes")
    p.add_argument("--official-src", help="the official GMMFormer (v2) repository's src folder: its evaluation "
                   "runs alternately with prvrlab's (benchmarks/official_eval.py)")
    p.add_argument("--official-site", help="a folder of packages the official code imports (official_eval.py --site)")
    p.add_argument("--peak-of", choices=["fast", "naive"], help="internal: one evaluation, print RSS before and peak")
    p.add_argument("--phase-peaks", action="store_true",
                   help="with the peak-RSS runs: RSS at the start, peak and end of each evaluation phase (Linux)")
    add_host_allocator_option(p)
    args = p.parse_args()
    set_host_allocator(args.host_allocator)

    torch.set_num_threads(args.threads)
    root = bench_collection(args)
    print(f"machine: {machine()}; native bf16 matrix units: {native_low_precision('cpu')}")
    print(f"this project's C++ kernels run on: {kernel_threads()}")
    if args.peak_of is None:  # not in the fresh peak-memory processes: the probe's buffers would count
        print(host_probe())
    print(f"load average at start: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    overrides = {} if args.video_batch is None else {"eval.video_batch_size": args.video_batch}
    if args.window_length is not None:
        overrides["model.window_length"] = args.window_length
    cfg = tvr_config(root, args.config, **overrides)
    print(f"model.window_length: {cfg.model.get('window_length', '-')}; eval.video_batch_size: {cfg.eval.video_batch_size}")
    seed_everything(0)
    t0 = time.perf_counter()
    collection = open_collection(cfg.data)
    print(f"open + check collection: {time.perf_counter() - t0:.1f} s")
    model = build_model(cfg.model, cfg.plugins, video_dim=collection.video_dim, query_dim=collection.query_dim)
    model.to(args.device)
    cuda = torch.device(args.device).type == "cuda"
    if cuda:
        print(f"device: {torch.cuda.get_device_name(args.device)}")
    backbone = str(cfg.model["name"])
    official = OFFICIAL_S.get(backbone)
    paths = {"fast": lambda split, amp: evaluate(model, collection, split, cfg.eval, device=args.device, amp_dtype=amp,
                                                 release_memory=True)}  # as `prvrlab eval`
    if not args.no_naive:
        paths["naive"] = lambda split, amp: naive(model, collection, split, cfg.eval, amp, args.device)
    native = native_low_precision(torch.device(args.device).type)
    if args.peak_of is not None:
        before = peak_rss_gib()
        phases = PhasePeaks()
        if args.phase_peaks:
            for name in PHASES:
                phases.wrap(retrieval, name)
        with primitive_cache_limit() if args.peak_of == "fast" else contextlib.nullcontext():  # as `prvrlab eval`
            res = paths[args.peak_of](args.splits[0], args.amp[0] if native else "none")
        for name, start, peak, end in phases.rows:
            print(f"phase {name:<14} start {start:.3f}  peak {peak:.3f}  end {end:.3f} GiB")
        print(f"{before:.4f} {phases.peak():.4f} {res.seconds:.3f}")
        return
    for asked in args.amp:
        amp = asked if asked == "none" or native else "none"  # both paths at the precision `evaluate` runs
        if amp != asked:
            print(f"[{asked:>4}] no native bf16 matrix units here: `prvrlab eval --amp {asked}` evaluates in fp32, so "
                  "both paths run fp32 (emulated bf16 would only slow the naive one down)")
        for split in args.splits:
            best: dict[str, EvalResult] = {}
            theirs: dict | None = None
            if cuda:
                torch.cuda.reset_peak_memory_stats(args.device)
            for _ in range(args.repeats):
                for name, run in paths.items():  # alternating: both see the same load
                    res = run(split, amp)
                    if name not in best or res.seconds < best[name].seconds:
                        best[name] = res
                if args.official_src is not None:
                    run_theirs = run_official(args, split)
                    if theirs is None or run_theirs["total_s"] < theirs["total_s"]:
                        theirs = run_theirs
            for name, res in best.items():
                t = res.timings
                print(
                    f"[{amp:>4}] {name:>5} {split:<4} {res.num_queries:>6} queries x {res.num_videos:>5} videos: "
                    f"videos {t.get('encode_videos', 0):6.1f} s  queries {t.get('encode_queries', 0):5.1f} s  "
                    f"scoring {t.get('score', 0):5.1f} s  total {res.seconds:6.1f} s"
                )
            fast = best["fast"]
            if "naive" in best:
                shift = abs(best["naive"].ranks.astype("int64") - fast.ranks.astype("int64"))
                print(f"[{amp:>4}] fast over naive (same run): {best['naive'].seconds / fast.seconds:.2f}x "
                      f"(ranks differ for {int((shift > 0).sum())} of {shift.size} queries, by at most {int(shift.max())}: "
                      f"near-ties between differently batched encodings)")
            if theirs is not None:
                print(f"[{amp:>4}] official {split:<4} {theirs['queries']:>6} queries x {theirs['videos']:>5} videos, fp32: "
                      f"videos {theirs['load_videos_s'] + theirs['encode_videos_s']:6.1f} s (waiting for batches "
                      f"{theirs['load_videos_s']:.1f} s)  queries + scoring + metrics {theirs['queries_score_metrics_s']:5.1f} s  "
                      f"total {theirs['total_s']:6.1f} s (its index set-up, {theirs['setup_s']:.1f} s, not counted); "
                      f"peak RSS {theirs['peak_rss_gib']:.2f} GiB")
                print(f"[{amp:>4}] fast over the official (same run, best of {args.repeats} each): "
                      f"{theirs['total_s'] / fast.seconds:.2f}x")
            elif official is not None and (fast.num_queries, fast.num_videos) == (2500, 500):
                print(f"[{amp:>4}] fast over the official {backbone} as issue 16 recorded it ({official} s on its "
                      f"machine, not this run; --official-src for a same-run ratio): {official / fast.seconds:.2f}x")
            if cuda:
                print(f"[{amp:>4}] peak GPU memory (allocated, all paths): "
                      f"{torch.cuda.max_memory_allocated(args.device) / 2**30:.2f} GiB")
            for name in () if args.no_memory or cuda else best:
                before, peak, seconds, phase_lines = peak_of(args, name, split, amp)
                print(f"[{amp:>4}] {name:>5} {split:<4} peak RSS of one evaluation in a fresh process: {peak:.2f} GiB "
                      f"({before:.2f} GiB before it: interpreter, model, opened collection); it took {seconds:.1f} s "
                      f"(nothing warmed up)")
                for line in phase_lines:
                    print(f"[{amp:>4}] {name:>5} {split:<4}   {line}")
    print(f"load average at end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
