"""Retrieval metrics and per-query rank tables (NumPy and Arrow only).

    recall_at        ranks -> {"r1", "r5", "r10", "r100", "sumr"} in percent
    chance_recall    what random scoring gets
    ratio_groups / recall_by_group   the moment/video-ratio breakdown (short/medium/long, group_bounds)
    rank_table / save_ranks / load_ranks   per-query ranks as Parquet

The trainer and the reports both read these; nothing here imports torch or a model, and pyarrow
is imported by the rank-table functions only (27 MiB resident: an evaluation process loads it once
its phases are over, when the table is first asked for).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import pyarrow as pa

DEFAULT_KS: tuple[int, ...] = (1, 5, 10, 100)
METRIC_KEYS: tuple[str, ...] = (*(f"r{k}" for k in DEFAULT_KS), "sumr")  # what recall_at returns

# Moment/video duration ratio groups (REFERENCE §1): upper bounds, inclusive.
GROUPS: tuple[str, ...] = ("short", "medium", "long")
GROUP_UPPER: tuple[float, ...] = (0.2, 0.4, 1.0)
RATIO_TOLERANCE = 1e-9  # relative: a group's upper bound also takes the division's rounding above it
UNGROUPED = ""  # label of ratios outside (0, inf) or NaN


# ---------------------------------------------------------------- metrics


def recall_at(ranks: np.ndarray | Sequence[int], ks: Sequence[int] = DEFAULT_KS) -> dict[str, float]:
    """Percent of queries whose rank is <= K, as ``{"r1": .., "r5": .., ..., "sumr": ..}``.

    ``sumr`` is the sum of the requested R@K values.
    """
    r = np.asarray(ranks)
    if r.ndim != 1 or r.size == 0:
        raise ValueError(f"ranks must be a non-empty 1-D array, got shape {r.shape}")
    if (r < 1).any():
        raise ValueError(f"ranks are 1-based, got a minimum of {r.min()}")
    out: dict[str, float] = {}
    for k in ks:
        if int(k) < 1:
            raise ValueError(f"K must be >= 1, got {k!r}")
        out[f"r{int(k)}"] = float((r <= int(k)).mean() * 100.0)
    out["sumr"] = float(sum(out.values()))
    return out


def chance_recall(num_videos: int, ks: Sequence[int] = DEFAULT_KS) -> dict[str, float]:
    """Expected R@K (percent) of random continuous scoring: ``min(K, Nv) / Nv * 100``."""
    if int(num_videos) < 1:
        raise ValueError(f"num_videos must be >= 1, got {num_videos!r}")
    out = {f"r{int(k)}": min(int(k), int(num_videos)) / int(num_videos) * 100.0 for k in ks}
    out["sumr"] = float(sum(out.values()))
    return out


def ratio_groups(ratios: np.ndarray | Sequence[float]) -> np.ndarray:
    """Moment/video ratio group of each query: ``"short"``, ``"medium"`` or ``"long"``.

    short: r in (0, 0.2]; medium: (0.2, 0.4]; long: (0.4, 1].  Ratios above 1
    (annotations that overrun the video's duration) count as long.  Ratios
    <= 0 or NaN get ``""`` (ungrouped).  Boundaries are compared in the
    array's own floating dtype, so a float32 0.2 is still short, with a
    relative tolerance of 1e-9 for the division's rounding: 1.2 s of 6 s
    (0.20000000000000004 as 3.6 - 2.4 over 6) is short as 0 - 1.2 of 6 is.
    """
    r = np.asarray(ratios)
    if not np.issubdtype(r.dtype, np.floating):
        r = r.astype(np.float64)
    labels = np.full(r.shape, UNGROUPED, dtype=object)
    lower = r.dtype.type(0.0)
    valid = r > lower  # False for NaN
    for name, upper in zip(GROUPS, GROUP_UPPER):
        up = r.dtype.type(upper * (1.0 + RATIO_TOLERANCE))  # float32: the bound itself
        hit = valid & (r <= up) if name != GROUPS[-1] else valid
        labels[hit] = name
        valid = valid & ~hit
    return labels


def group_bounds() -> tuple[tuple[str, float, float], ...]:
    """``(name, low, high)`` per group: ratios in (low, high] (the last group also takes ratios above 1)."""
    return tuple(zip(GROUPS, (0.0, *GROUP_UPPER[:-1]), GROUP_UPPER))


def recall_by_group(
    ranks: np.ndarray | Sequence[int],
    ratios: np.ndarray | Sequence[float],
    ks: Sequence[int] = DEFAULT_KS,
) -> dict[str, dict[str, float]]:
    """``recall_at`` per ratio group, each dict with an extra ``"count"``.

    Every group of ``GROUPS`` is present; an empty group has ``count`` 0 and
    NaN metrics.  Ungrouped queries (ratio <= 0 or NaN) are left out.
    """
    r = np.asarray(ranks)
    labels = ratio_groups(ratios)
    if labels.shape != r.shape:
        raise ValueError(f"ranks {r.shape} and ratios {labels.shape} must have the same shape")
    out: dict[str, dict[str, float]] = {}
    for name in GROUPS:
        mask = labels == name
        count = int(mask.sum())
        if count:
            metrics = recall_at(r[mask], ks)
        else:
            metrics = {f"r{int(k)}": float("nan") for k in ks}
            metrics["sumr"] = float("nan")
        metrics["count"] = count
        out[name] = metrics
    return out


# ---------------------------------------------------------------- rank tables


def rank_table(
    query_ids: Sequence[str],
    video_ids_of_queries: Sequence[str],
    ranks: np.ndarray | Sequence[int],
    ratios: np.ndarray | Sequence[float] | None = None,
) -> pa.Table:
    """Per-query table: ``query_id`` (string), ``video_id`` (string, the ground
    truth), ``rank`` (int64), and ``ratio`` (float64) when ratios are given."""
    import pyarrow as pa

    n = len(query_ids)
    r = np.asarray(ranks, dtype=np.int64)
    if len(video_ids_of_queries) != n or r.shape != (n,):
        raise ValueError(
            f"query_ids ({n}), video_ids_of_queries ({len(video_ids_of_queries)}) "
            f"and ranks {r.shape} must have the same length"
        )
    columns = {
        "query_id": pa.array([str(q) for q in query_ids], type=pa.string()),
        "video_id": pa.array([str(v) for v in video_ids_of_queries], type=pa.string()),
        "rank": pa.array(r, type=pa.int64()),
    }
    if ratios is not None:
        rat = np.asarray(ratios, dtype=np.float64)
        if rat.shape != (n,):
            raise ValueError(f"ratios has shape {rat.shape}, expected ({n},)")
        columns["ratio"] = pa.array(rat, type=pa.float64())
    return pa.table(columns)


def save_ranks(path: str | Path, table: pa.Table) -> Path:
    """Write a rank table to Parquet (parent folders created; whole or not at all); returns the path."""
    import pyarrow.parquet as pq

    from prvrlab.files import replace_atomically

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return replace_atomically(path, lambda tmp: pq.write_table(table, tmp))


def load_ranks(path: str | Path) -> pa.Table:
    """Read a rank table written by ``save_ranks``."""
    import pyarrow.parquet as pq

    return pq.read_table(Path(path))
