"""Build ModelOutput / Batch objects directly for the loss tests."""

from __future__ import annotations

import torch

from prvrlab.data.batch import Batch
from prvrlab.models.base import BranchScores, ModelOutput, QueryEmbedding, VideoEmbedding


def make_batch(query_video: list[int], num_videos: int) -> Batch:
    nq = len(query_video)
    return Batch(
        frames=torch.zeros(num_videos, 2, 3),
        frame_mask=torch.ones(num_videos, 2, dtype=torch.bool),
        clips=torch.zeros(num_videos, 2, 3),
        queries=torch.zeros(nq, 2, 3),
        query_mask=torch.ones(nq, 2, dtype=torch.bool),
        query_video=torch.tensor(query_video, dtype=torch.long),
        video_ids=[f"v{i}" for i in range(num_videos)],
        query_ids=[f"q{i}" for i in range(nq)],
    )


def make_output(
    sim: torch.Tensor | None = None,
    logits: torch.Tensor | None = None,
    vectors: torch.Tensor | None = None,
    branch: str = "clip",
    targets: torch.Tensor | None = None,
) -> ModelOutput:
    scores = {} if sim is None else {branch: BranchScores(sim=sim, logits=logits, targets=targets)}
    query = QueryEmbedding(vectors={} if vectors is None else {branch: vectors})
    return ModelOutput(scores=scores, query=query, video=VideoEmbedding())
