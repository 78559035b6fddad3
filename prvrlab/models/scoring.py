"""Batched query-video scoring shared by the backbones.

Scores are computed in fp32 with autocast disabled, as one matrix product per
chunk of videos (never a Python loop over queries or videos).
"""

from __future__ import annotations

import torch
from torch import Tensor

from prvrlab.models.base import BranchScores

# Upper bound on the (Nq, chunk, L) score tensor built at once (elements).
_MAX_CHUNK_ELEMENTS = 1 << 26
_EPS = 1e-6


def vector_scores(query: Tensor, video: Tensor, *, with_logits: bool = False) -> BranchScores:
    """Cosine (and raw dot) scores of (Nq, D) queries against (Nv, D) video vectors."""
    with torch.autocast(device_type=query.device.type, enabled=False):
        q = query.float()  # (Nq, D)
        v = video.float()  # (Nv, D)
        dots = q @ v.t()  # (Nq, Nv)
        norms = q.norm(dim=-1).clamp(min=_EPS)[:, None] * v.norm(dim=-1).clamp(min=_EPS)[None, :]  # (Nq, Nv)
        return BranchScores(sim=dots / norms, logits=dots if with_logits else None)


def max_scores(
    query: Tensor, video: Tensor, mask: Tensor | None = None, *, with_logits: bool = False
) -> BranchScores:
    """Max over each video's vectors of the cosine (and, separately, of the raw dot).

    ``query`` (Nq, D); ``video`` (Nv, L, D) with an optional (Nv, L) mask whose
    False positions never win the max (a video without real vectors scores -1
    in ``sim`` and its min-float in ``logits``).
    """
    nq = query.shape[0]
    nv, length, dim = video.shape
    if nv == 0 or length == 0:
        empty = query.new_full((nq, nv), -1.0, dtype=torch.float32)  # (Nq, Nv)
        return BranchScores(sim=empty, logits=empty.clone() if with_logits else None)
    chunk = max(1, _MAX_CHUNK_ELEMENTS // max(1, nq * length))
    sims, logits = [], []
    with torch.autocast(device_type=query.device.type, enabled=False):
        q = query.float()  # (Nq, D)
        q_norm = q.norm(dim=-1).clamp(min=_EPS)  # (Nq,)
        for start in range(0, nv, chunk):
            v = video[start : start + chunk].float()  # (C, L, D)
            c = v.shape[0]
            dots = (q @ v.reshape(c * length, dim).t()).view(nq, c, length)  # (Nq, C, L)
            v_norm = v.norm(dim=-1).clamp(min=_EPS)  # (C, L)
            cos = dots / (q_norm[:, None, None] * v_norm[None])  # (Nq, C, L)
            if mask is not None:
                pad = ~mask[start : start + chunk].to(torch.bool)[None]  # (1, C, L)
                cos = cos.masked_fill(pad, -1.0)
                if with_logits:
                    dots = dots.masked_fill(pad, torch.finfo(dots.dtype).min)
            sims.append(cos.amax(dim=-1))  # (Nq, C)
            if with_logits:
                logits.append(dots.amax(dim=-1))  # (Nq, C)
        sim = sims[0] if len(sims) == 1 else torch.cat(sims, dim=1)  # (Nq, Nv)
        if not with_logits:
            return BranchScores(sim=sim)
        logit = logits[0] if len(logits) == 1 else torch.cat(logits, dim=1)  # (Nq, Nv)
        return BranchScores(sim=sim, logits=logit)
