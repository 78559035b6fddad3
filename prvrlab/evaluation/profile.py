"""Efficiency of a model, as the PRVR papers report it.

- **Params (M)**: trainable and frozen parameters of the backbone.
- **FLOPs (G)**: one query and one video through the model (encode both, score
  the pair), counted with ``torch.utils.flop_counter.FlopCounterMode`` (matmul-type
  operations; a multiply-add counts as 2 FLOPs).
- **Online FLOPs / query (G)**: what retrieval costs per query at the largest
  gallery: encode the query + score it against every (pre-encoded) video.
- **ms / query at gallery size N**: videos are encoded offline once (random
  inputs shaped like the config's data); per query = encode the query + fuse
  the branch scores against the first N videos; the median over ``queries``
  single-query runs after a warm-up.
- **Memory (MB)**: the offline video index (all tensors of the encoded gallery
  as the backbone indexes it for retrieval, ``index_videos``) at the largest
  gallery size, plus the CUDA peak when profiling on a GPU.

Inputs are random (seeded); only the shapes matter for cost. The tables are written by
:mod:`prvrlab.reports.profile`, which takes these results (``prvrlab profile``, ``prvrlab report --profile``).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from prvrlab.data.errors import DataError

DEFAULT_GALLERIES: tuple[int, ...] = (500, 1000, 1500, 2000, 2500)
KNOWN_DIMS = {"tvr": (3072, 768), "activitynet": (1024, 1024), "charades": (1024, 1024)}


@dataclass
class ProfileResult:
    """What :func:`profile_model` measured."""

    name: str
    params: int
    flops_pair: float
    flops_query: float  # online, at the largest gallery
    ms_per_query: dict[int, float] = field(default_factory=dict)
    index_mb: float = 0.0
    cuda_peak_mb: float | None = None
    device: str = "cpu"
    threads: int = 1  # torch's intra-op threads while measuring


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if hasattr(obj, "__dataclass_fields__"):
        return sum(_tensor_bytes(getattr(obj, f)) for f in obj.__dataclass_fields__)
    return 0


def _flops(fn) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        fn()
    return float(counter.get_total_flops())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_model(
    model: torch.nn.Module,
    *,
    video_dim: int,
    query_dim: int,
    num_clips: int = 32,
    max_frames: int = 128,
    query_len: int = 30,
    galleries: Sequence[int] = DEFAULT_GALLERIES,
    queries: int = 20,
    warmup: int = 2,
    video_batch: int = 64,
    device: str | torch.device = "cpu",
    seed: int = 0,
    name: str = "model",
) -> ProfileResult:
    """Measure parameters, FLOPs, per-query latency per gallery size and index memory."""
    galleries = sorted({int(g) for g in galleries})
    if not galleries or galleries[0] < 1:
        raise ValueError(f"gallery sizes must be positive integers, got {list(galleries)}")
    device = torch.device(device)
    model = model.to(device).eval()
    gen = torch.Generator().manual_seed(seed)

    def videos(n: int):
        clips = torch.randn(n, num_clips, video_dim, generator=gen)
        frames = torch.randn(n, max_frames, video_dim, generator=gen)
        mask = torch.ones(n, max_frames, dtype=torch.bool)
        return clips.to(device), frames.to(device), mask.to(device)

    qx = torch.randn(queries, query_len, query_dim, generator=gen).to(device)
    qm = torch.ones(queries, query_len, dtype=torch.bool, device=device)
    params = sum(p.numel() for p in model.parameters())

    with torch.inference_mode():
        one_video = videos(1)

        def pair() -> None:
            v = model.encode_videos(*one_video)
            q = model.encode_queries(qx[:1], qm[:1])
            model.fuse(model.score(q, v))

        flops_pair = _flops(pair)

        parts = []
        largest = galleries[-1]
        for start in range(0, largest, video_batch):
            parts.append(model.encode_videos(*videos(min(video_batch, largest - start))))
        from prvrlab.models.base import VideoEmbedding

        index = model.index_videos(VideoEmbedding.cat(parts) if len(parts) > 1 else parts[0])  # as retrieval scores it
        index_mb = _tensor_bytes(index) / 2**20

        def online(gallery) -> None:
            q = model.encode_queries(qx[:1], qm[:1])
            model.fuse(model.score(q, gallery))

        flops_query = _flops(lambda: online(index))

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        ms: dict[int, float] = {}
        for g in galleries:
            gallery = index.index(slice(0, g))
            for i in range(warmup):
                online(gallery)
            _sync(device)
            times = []
            for i in range(queries):
                t0 = time.perf_counter()
                q = model.encode_queries(qx[i : i + 1], qm[i : i + 1])
                model.fuse(model.score(q, gallery))
                _sync(device)
                times.append((time.perf_counter() - t0) * 1000.0)
            ms[g] = statistics.median(times)
        peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    return ProfileResult(name, params, flops_pair, flops_query, ms, index_mb, peak, str(device), torch.get_num_threads())


def model_dims(cfg) -> tuple[int, int]:
    """(video_dim, query_dim) of a config's data: read from the collection when it exists, else those of the
    synthetic preset it names (``data.synthesize``: its data need not be written), else known defaults.

    ``cfg``: a validated experiment config (only ``cfg.data`` is read); a DataError when neither works.
    """
    from prvrlab.data.collection import open_collection

    try:
        coll = open_collection(cfg.data, validate_splits=False, allow_synthesize=False)
        return int(coll.video_dim), int(coll.query_dim)
    except (DataError, OSError, FileNotFoundError):
        pass
    if cfg.data.synthesize:
        from prvrlab.data.synth import get_preset

        preset = get_preset(cfg.data.synthesize)
        return int(preset.video_dim), int(preset.query_dim)
    if cfg.data.collection in KNOWN_DIMS:
        return KNOWN_DIMS[cfg.data.collection]
    raise DataError(
        f"cannot tell the feature sizes of collection '{cfg.data.collection}': its data root {cfg.data.root} "
        "is not readable; pass --video-dim and --query-dim to prvrlab profile (report --profile reads the sizes "
        "from the data)"
    )


def profile_config(
    cfg,
    *,
    galleries: Sequence[int] = DEFAULT_GALLERIES,
    queries: int = 20,
    video_dim: int | None = None,
    query_dim: int | None = None,
    device: str | None = None,
    name: str | None = None,
) -> ProfileResult:
    """Build the config's model (random weights) and profile it.

    ``cfg`` is an already validated experiment config, built by the caller (the
    CLI validates it): ``.model``, ``.plugins`` and ``.data`` are read, plus
    ``.train.use_gpu`` when ``device`` is None and ``.name`` when ``name`` is.
    """
    from prvrlab.evaluation.retrieval import saved_model_device
    from prvrlab.models.factory import build_model

    if video_dim is None or query_dim is None:
        vd, qd = model_dims(cfg)
        video_dim, query_dim = video_dim or vd, query_dim or qd
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.plugins, video_dim=video_dim, query_dim=query_dim)
    dev = saved_model_device(cfg.train.use_gpu, device)
    return profile_model(
        model,
        video_dim=video_dim,
        query_dim=query_dim,
        num_clips=cfg.data.num_clips,
        max_frames=cfg.data.max_frames,
        query_len=cfg.data.max_query_len,
        galleries=galleries,
        queries=queries,
        device=dev,
        name=name or cfg.name,
    )
