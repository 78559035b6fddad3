"""The synthetic videos' features live in another random space than the queries': a query's raw
token features say nothing about its own video's raw frames (models must learn the mapping)."""

from __future__ import annotations

import numpy as np

from prvrlab.data.collection import open_collection
from prvrlab.data.config import DataConfig


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def test_raw_query_features_do_not_find_their_videos(tiny_root):
    col = open_collection(DataConfig(root=str(tiny_root)))
    split = col.split("train")
    d = min(col.video_dim, col.query_dim)  # the dimensions both spaces have
    frames = [_unit(col.visual.frames(v)[:, :d]) for v in split.video_ids]  # per video (Lf, d)
    own, other = [], []
    for q, v in zip(split.query_ids, split.query_video):
        query = _unit(col.queries.tokens(q).mean(axis=0)[:d])  # (d,)
        best = np.array([float((f @ query).max()) for f in frames])  # best frame of every video
        own.append(best[v])
        other.append(np.delete(best, v).mean())
    # a shared space would put each query's own video well above the others (the best frame shows it)
    assert abs(np.mean(own) - np.mean(other)) < 0.05
