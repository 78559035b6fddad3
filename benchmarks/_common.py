"""Shared setup of the end-to-end benchmarks: a TVR-shaped synthetic collection,
the GMMFormer TVR config (configs/gmmformer_tvr.yaml) pointed at it, and the
timed training step (model + loss terms + AdamW, data excluded)."""

from __future__ import annotations

import argparse
import dataclasses
import platform
import resource
import time
from pathlib import Path

import torch

from prvrlab.allocator import HOST_ALLOCATORS
from prvrlab.data.dataset import train_loader
from prvrlab.data.synth import PRESETS, synthesize
from prvrlab.evaluation.retrieval import resolve_amp_dtype
from prvrlab.models.factory import TrainingSystem, build_system
from prvrlab.platform.config import apply_overrides, load_raw, validate
from prvrlab.platform.train.loop import seed_everything
from prvrlab.platform.train.optim import build_optimizer

REPO = Path(__file__).resolve().parents[1]


def tvr_bench_collection(root: Path, train_videos: int, val_videos: int, test_videos: int) -> Path:
    """TVR's dimensions (3,072-d video, 768-d text, 5 queries per video) at chosen sizes."""
    preset = dataclasses.replace(
        PRESETS["tvr"], name=f"tvr-bench-{train_videos}-{val_videos}-{test_videos}",
        videos=(train_videos, val_videos, test_videos),
    )
    marker = root / "synth.json"
    if not marker.exists() or preset.name not in marker.read_text():
        synthesize(root, preset=preset, seed=0, progress=True)
    return root


def add_collection_options(p: argparse.ArgumentParser) -> None:
    """``--root`` and the split sizes of the TVR-shaped collection (:func:`bench_collection` writes it once)."""
    p.add_argument("--root", default="data/bench_tvr", help="the TVR-shaped collection (written once)")
    p.add_argument("--train-videos", type=int, default=1280)
    p.add_argument("--val-videos", type=int, default=500)
    p.add_argument("--test-videos", type=int, default=2179)


def bench_collection(args: argparse.Namespace) -> Path:
    """The TVR-shaped collection that :func:`add_collection_options`' arguments name."""
    return tvr_bench_collection(Path(args.root), args.train_videos, args.val_videos, args.test_videos)


def tvr_config(root: Path, config: str = "gmmformer_tvr.yaml", **overrides):
    """A TVR config from configs/ (GMMFormer by default) on the synthetic TVR-shaped collection."""
    raw = load_raw(REPO / "configs" / config)
    base = {
        "data.root": str(root),
        "data.collection": "synth",
        "data.visual_feature": "synth_feat",
        "data.text_feature": None,
        "data.val_split": "val",
        "data.test_split": "test",
    }
    return validate(apply_overrides(raw, {**base, **overrides}))


def bench_system(cfg, collection) -> TrainingSystem:
    """The config's backbone, plug-ins and loss terms, seeded as a run's (seed 0)."""
    seed_everything(0)
    return build_system(cfg.model, cfg.plugins, cfg.losses, video_dim=collection.video_dim,
                        query_dim=collection.query_dim)


def step_seconds(system: TrainingSystem, collection, *, batch_size: int, steps: int, amp: str, epoch: int = 0) -> float:
    """Mean seconds of forward + losses + backward + AdamW over ``steps`` training batches of
    ``batch_size`` videos, after one untimed step; data loading is not timed."""
    loader, _ = train_loader(collection, "train", batch_size_per_rank=batch_size, rank=0, world_size=1, seed=0,
                             num_workers=0)
    opt, _ = build_optimizer(system, lr=1e-4, weight_decay=0.01, total_steps=100, warmup_proportion=0.0)
    dtype = resolve_amp_dtype(amp)
    batches, times = iter(loader), []
    system.train()
    for i in range(steps + 1):
        batch = next(batches)
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            result, _ = system(batch, epoch=epoch)
        opt.zero_grad(set_to_none=True)
        result.total.backward()
        opt.step()
        if i:
            times.append(time.perf_counter() - t0)
    return sum(times) / len(times)


def status_gib(key: str) -> float | None:
    """``key`` (VmRSS, VmHWM, RssAnon) of /proc/self/status in GiB, or None where there is none."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 2**20  # kB
    except OSError:
        pass
    return None


def peak_rss_gib() -> float:
    """Peak resident memory of this process (GiB): VmHWM of /proc/self/status where there is one.

    Not ``ru_maxrss`` there: Linux carries it over fork and exec, so a benchmark started by a big
    process would report its parent's resident set at the fork."""
    hwm = status_gib("VmHWM")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20 if hwm is None else hwm


def reset_peak_rss() -> None:
    """Set this process's peak resident memory (VmHWM) back to its current resident set (Linux), so that the
    next :func:`peak_rss_gib` is the peak since now; nothing where the kernel has no ``clear_refs``."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}, {platform.python_version()}"


def _rate(work: float, run, seconds: float = 0.4) -> float:
    """``work`` units per second of ``run()``, best of the repeats within ``seconds`` after one warm-up."""
    run()
    best, spent = float("inf"), 0.0
    while spent < seconds:
        t = time.perf_counter()
        run()
        dt = time.perf_counter() - t
        best, spent = min(best, dt), spent + dt
    return work / best


def host_probe() -> str:
    """This host's speed on what evaluation and training spend their time in (about 1.5 s), to tell a
    slower host from a slower code when figures are compared across sessions: the bf16 product of
    GMMFormer's FFN shape, the scoring product (bf16 values, float32 result: oneDNN's bf16 math mode;
    ``models.precision.bf16_products``), the float32 product, and a 256 MiB float32 copy.  (Session 41:
    the same code evaluated v2 2.3x slower than in session 34 on a host of the same kind, GEMM roofs
    alike.)"""
    from prvrlab.models.precision import bf16_products

    a, b = torch.randn(4096, 384), torch.randn(384, 1536)
    a16, b16 = a.bfloat16(), b.bfloat16()
    flop = 2 * 4096 * 384 * 1536 / 1e9
    bf16 = _rate(flop, lambda: a16 @ b16)
    fp32 = _rate(flop, lambda: a @ b)
    q, v = a16.float(), b16.float()
    with bf16_products(True) as on:
        scoring = _rate(flop, lambda: q @ v) if on else float("nan")
    src = torch.empty(64 << 20)
    dst = torch.empty_like(src)
    copy = _rate(2 * src.numel() * 4 / 1e9, lambda: dst.copy_(src))
    # the CPU's vector level: session 42's host was AVX2 only, where bf16 is emulated (earlier ones AVX512)
    capability = torch.backends.cpu.get_cpu_capability()
    return (f"host: {capability}, GEMM bf16 {bf16:.0f}, scoring product {scoring:.0f}, fp32 {fp32:.0f} GFLOP/s; "
            f"memory copy {copy:.0f} GB/s")


def add_host_allocator_option(p: argparse.ArgumentParser) -> None:
    """``--host-allocator keep|system``: train.host_allocator of the benchmark's process."""
    p.add_argument("--host-allocator", choices=list(HOST_ALLOCATORS), default="keep",
                   help="train.host_allocator of this process (benchmarks/bench_allocator.py compares them)")
