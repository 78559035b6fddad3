"""Validate a collection on disk and summarise it (``prvrlab data inspect``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from prvrlab.data.collection import SplitIndex, configured_splits, open_collection
from prvrlab.data.integrity import check_query_features, check_visual_features
from prvrlab.evaluation.metrics import GROUPS, ratio_groups

if TYPE_CHECKING:
    from prvrlab.data.config import DataConfig


@dataclass
class SplitStats:
    """Counts and length statistics of one split."""

    name: str
    caption_file: Path
    videos: int
    queries: int
    queries_per_video: tuple[int, float, int]  # min, mean, max
    frames: tuple[int, float, int]  # raw frames per video: min, mean, max
    videos_pooled: int  # videos with more than max_frames frames (mean-pooled)
    tokens: tuple[int, float, int]  # raw tokens per query: min, mean, max
    queries_truncated: int  # queries longer than max_query_len
    ratio_groups: dict[str, int] | None  # queries per moment/video ratio group, None without timestamps
    resident_bytes: int  # the preprocessed split in float32: what data.resident holds on the device


@dataclass
class InspectReport:
    """What :func:`inspect_collection` found; :meth:`format` renders it as text."""

    collection: str
    root: Path
    visual_path: Path
    visual_format: str
    video_dim: int
    feature_videos: int
    query_path: Path
    query_dim: int
    query_features: int
    max_frames: int
    max_query_len: int
    splits: list[SplitStats]
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def format(self) -> str:
        """A readable multi-line summary with one table row per split."""
        lines = [
            f"collection {self.collection!r} at {self.root}",
            f"  visual  {self.visual_path} ({self.visual_format}): {self.feature_videos} videos, dim {self.video_dim}",
            f"  queries {self.query_path}: {self.query_features} queries, dim {self.query_dim}",
        ]
        lines += [f"  note: {n}" for n in self.notes] + [""]
        header = (
            "split",
            "videos",
            "queries",
            "q/video min/mean/max",
            "frames min/mean/max",
            f">{self.max_frames} fr",
            "tokens min/mean/max",
            f">{self.max_query_len} tok",
            "short/medium/long",
            "resident GiB",
        )
        rows = [header]
        for s in self.splits:
            groups = "-" if s.ratio_groups is None else "/".join(str(v) for v in s.ratio_groups.values())
            rows.append(
                (
                    s.name,
                    str(s.videos),
                    str(s.queries),
                    _triple(s.queries_per_video),
                    _triple(s.frames),
                    str(s.videos_pooled),
                    _triple(s.tokens),
                    str(s.queries_truncated),
                    groups,
                    f"{s.resident_bytes / 2**30:.2f}",
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        for r in rows:
            lines.append("  " + "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


def _triple(t: tuple[int, float, int]) -> str:
    return f"{t[0]}/{t[1]:.1f}/{t[2]}"


def _stats(values: np.ndarray) -> tuple[int, float, int]:
    return int(values.min()), float(values.mean()), int(values.max())


def split_stats(
    index: SplitIndex, *, max_frames: int, max_query_len: int, num_clips: int, video_dim: int, query_dim: int
) -> SplitStats:
    """Summary statistics of one split index."""
    groups = None
    if index.ratios is not None:
        labels = ratio_groups(index.ratios)
        groups = {name: int((labels == name).sum()) for name in GROUPS}
    return SplitStats(
        name=index.name,
        caption_file=index.caption_file,
        videos=index.num_videos,
        queries=index.num_queries,
        queries_per_video=_stats(np.diff(index.query_offsets)),
        frames=_stats(index.frame_counts),
        videos_pooled=int((index.frame_counts > max_frames).sum()),
        tokens=_stats(index.token_counts),
        queries_truncated=int((index.token_counts > max_query_len).sum()),
        ratio_groups=groups,
        resident_bytes=index.preprocessed_bytes(
            max_frames=max_frames, num_clips=num_clips, max_query_len=max_query_len, video_dim=video_dim, query_dim=query_dim
        ),
    )


def inspect_collection(cfg: "DataConfig", splits: Sequence[str] | None = None) -> InspectReport:
    """Check every file of the collection ``cfg`` describes and summarise it.

    Checks ``splits`` (default: the configured train/val/test splits) fully:
    feature.bin size against shape.txt, id.txt and video2frames.txt
    consistency, a caption whose video has no features, a query id missing
    from the query HDF5, dimension mismatches, empty videos or queries,
    zero-frame videos, NaN/inf features anywhere in the store and in the
    inspected splits' query tokens.  The first problem raises
    :class:`DataError` naming the file and the id.
    Never generates synthetic data.
    """
    collection = open_collection(cfg, validate_splits=False, allow_synthesize=False)
    check_visual_features(collection.visual)
    names = list(splits) if splits is not None else configured_splits(cfg)
    indexes = [collection.split(n) for n in names]
    check_query_features(collection.queries, list(dict.fromkeys(q for i in indexes for q in i.query_ids)))
    collection.close()
    warnings = []
    seen: dict[str, str] = {}
    for index in indexes:
        shared = [v for v in index.video_ids if v in seen]
        if shared:
            warnings.append(
                f"{len(shared)} videos of split {index.name!r} also appear in split {seen[shared[0]]!r} "
                f"(e.g. {shared[0]!r})"
            )
        seen.update((v, index.name) for v in index.video_ids if v not in seen)
    return InspectReport(
        collection=collection.name,
        root=collection.root,
        visual_path=collection.visual.path,
        visual_format=collection.visual.format,
        video_dim=collection.video_dim,
        feature_videos=len(collection.visual),
        query_path=collection.queries.path,
        query_dim=collection.query_dim,
        query_features=len(collection.queries),
        max_frames=collection.max_frames,
        max_query_len=collection.max_query_len,
        splits=[
            split_stats(
                i,
                max_frames=collection.max_frames,
                max_query_len=collection.max_query_len,
                num_clips=collection.num_clips,
                video_dim=collection.video_dim,
                query_dim=collection.query_dim,
            )
            for i in indexes
        ],
        warnings=warnings,
        notes=collection.notes,
    )
