"""Shared setup of the end-to-end benchmarks: a TVR-shaped synthetic collection
and the GMMFormer TVR config (configs/gmmformer_tvr.yaml) pointed at it."""

from __future__ import annotations

import dataclasses
import platform
import resource
from pathlib import Path

import torch

from prvrlab.data.synth import PRESETS, synthesize
from prvrlab.platform.config import apply_overrides, load_raw, validate

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


def peak_rss_gib() -> float:
    """Peak resident memory of this process (GiB): VmHWM of /proc/self/status where there is one.

    Not ``ru_maxrss`` there: Linux carries it over fork and exec, so a benchmark started by a big
    process would report its parent's resident set at the fork."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


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
