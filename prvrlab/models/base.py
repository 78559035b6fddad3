"""The contract every backbone fulfils, and the typed objects it returns.

A backbone encodes videos and queries separately (so evaluation encodes each
video once) and scores any set of queries against any set of videos, per
*branch* (e.g. ``"clip"`` and ``"frame"``).  The final retrieval score is the
weighted sum of the branch similarities with ``score_weights``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch
from torch import Tensor, nn

from prvrlab.data.batch import Batch


def _map_tensors(obj, fn):
    """Apply ``fn`` to every Tensor field of a dataclass, keeping the others."""
    changes = {}
    for f in fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, Tensor):
            changes[f.name] = fn(v)
        elif isinstance(v, dict):
            changes[f.name] = {k: fn(t) if isinstance(t, Tensor) else t for k, t in v.items()}
    return replace(obj, **changes)


@dataclass
class VideoEmbedding:
    """Encoded videos; every tensor has the video index as its first dimension.

    ``clip``: (Nv, Lc, D) clip-level embeddings.  ``frame``: (Nv, D) pooled or
    (Nv, Lf, D) per-frame embeddings with ``frame_mask`` (Nv, Lf).  ``extra``
    holds backbone- or plug-in-specific per-video tensors (first dim Nv).
    """

    clip: Tensor | None = None
    frame: Tensor | None = None
    frame_mask: Tensor | None = None
    extra: dict[str, Tensor] = field(default_factory=dict)

    def to(self, device: torch.device | str) -> "VideoEmbedding":
        return _map_tensors(self, lambda t: t.to(device))

    def detach(self) -> "VideoEmbedding":
        return _map_tensors(self, lambda t: t.detach())

    def index(self, idx: Tensor | slice) -> "VideoEmbedding":
        """The embeddings of a subset of videos (first-dimension indexing)."""
        return _map_tensors(self, lambda t: t[idx])

    @staticmethod
    def cat(parts: list["VideoEmbedding"]) -> "VideoEmbedding":
        """Concatenate along videos, zero/False-padding dim 1 where lengths differ."""
        return _cat(parts)


@dataclass
class QueryEmbedding:
    """Encoded queries; every tensor has the query index as its first dimension.

    ``vectors`` maps a branch name to its (Nq, D) query vector (a backbone may
    use one shared vector for all branches).  ``tokens`` (Nq, Lq, D) and
    ``token_mask`` (Nq, Lq) keep the word-level encodings for plug-ins.
    """

    vectors: dict[str, Tensor] = field(default_factory=dict)
    tokens: Tensor | None = None
    token_mask: Tensor | None = None
    extra: dict[str, Tensor] = field(default_factory=dict)

    def to(self, device: torch.device | str) -> "QueryEmbedding":
        return _map_tensors(self, lambda t: t.to(device))

    def detach(self) -> "QueryEmbedding":
        return _map_tensors(self, lambda t: t.detach())

    def index(self, idx: Tensor | slice) -> "QueryEmbedding":
        return _map_tensors(self, lambda t: t[idx])

    @staticmethod
    def cat(parts: list["QueryEmbedding"]) -> "QueryEmbedding":
        return _cat(parts)


def _cat(parts):
    first = parts[0]
    changes = {}
    for f in fields(first):
        v = getattr(first, f.name)
        if isinstance(v, Tensor):
            changes[f.name] = _pad_cat([getattr(p, f.name) for p in parts])
        elif isinstance(v, dict):
            changes[f.name] = {
                k: _pad_cat([getattr(p, f.name)[k] for p in parts]) for k in v
            }
    return replace(first, **changes)


def _pad_cat(tensors: list[Tensor]) -> Tensor:
    if tensors[0].dim() < 2 or all(t.shape[1:] == tensors[0].shape[1:] for t in tensors):
        return torch.cat(tensors, dim=0)
    length = max(t.shape[1] for t in tensors)
    padded = []
    for t in tensors:
        if t.shape[1] < length:
            pad_shape = (t.shape[0], length - t.shape[1], *t.shape[2:])
            t = torch.cat([t, t.new_zeros(pad_shape)], dim=1)
        padded.append(t)
    return torch.cat(padded, dim=0)


@dataclass
class BranchScores:
    """Scores of one branch for every (query, video) pair.

    ``sim``: (Nq, Nv) cosine similarities used for ranking and triplet losses.
    ``logits``: (Nq, Nv) unnormalised dot products used by InfoNCE (None when a
    backbone has no such notion; losses needing it then raise).
    """

    sim: Tensor
    logits: Tensor | None = None


@dataclass
class ModelOutput:
    """What ``RetrievalModel.forward`` returns for a training batch."""

    scores: dict[str, BranchScores]  # branch name -> (Nq, B) scores
    query: QueryEmbedding
    video: VideoEmbedding
    aux: dict[str, Tensor] = field(default_factory=dict)  # plug-in extras


class RetrievalModel(nn.Module):
    """Base class of every backbone.

    Subclasses implement ``encode_videos``, ``encode_queries`` and ``score``;
    ``forward`` (training) and ``fuse`` (retrieval score) come from here.
    ``score_weights`` maps each branch to its weight in the final score.
    """

    score_weights: dict[str, float]
    # Generic plug-in hook: a backbone whose ``VideoEmbedding.frame`` is pooled
    # also returns its per-frame embeddings in ``extra['frame_tokens']`` (Nv, Lf, D)
    # and ``extra['frame_mask']`` (Nv, Lf) when this is True (off by default so
    # that retrieval without plug-ins keeps no per-frame tensors).
    expose_frame_tokens: bool = False

    def encode_videos(self, clips: Tensor, frames: Tensor, frame_mask: Tensor) -> VideoEmbedding:
        """Encode (B, Lc, Dv) clips and (B, Lf, Dv) frames with a (B, Lf) mask."""
        raise NotImplementedError

    def encode_queries(self, queries: Tensor, query_mask: Tensor) -> QueryEmbedding:
        """Encode (Nq, Lq, Dq) token features with a (Nq, Lq) mask."""
        raise NotImplementedError

    def score(
        self, query: QueryEmbedding, video: VideoEmbedding, *, with_logits: bool = False
    ) -> dict[str, BranchScores]:
        """Per-branch (Nq, Nv) scores of every query against every video."""
        raise NotImplementedError

    def fuse(self, scores: dict[str, BranchScores]) -> Tensor:
        """Final (Nq, Nv) retrieval score: weighted sum of branch similarities."""
        total = None
        for name, weight in self.score_weights.items():
            if weight == 0.0:
                continue
            part = weight * scores[name].sim
            total = part if total is None else total + part
        if total is None:
            raise ValueError("all score_weights are zero")
        return total

    def forward(self, batch: Batch) -> ModelOutput:
        video = self.encode_videos(batch.clips, batch.frames, batch.frame_mask)
        query = self.encode_queries(batch.queries, batch.query_mask)
        scores = self.score(query, video, with_logits=True)
        return ModelOutput(scores=scores, query=query, video=video)
