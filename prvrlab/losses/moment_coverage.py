"""Moment coverage: queries of the same video should attend to different frames.

In PRVR every query describes one moment of its video, and the queries of a
video describe *different* moments.  This training-only loss lets each query
attend over the real frames of its own video and penalises the overlap of
the attentions of two queries of the same video.

With ``q_i = out.query.vectors[branch][i]``, ``f_vj`` the per-frame tokens of
video v (capability ``frame_tokens``), ``v(i)`` the video of query i
(capability ``query_groups``) and the learnable temperature
``tau = max(exp(log_temperature), min_temperature)``::

    a_i(j)  = softmax over the real frames j of v(i) of cos(q_i, f_v(i)j) / tau   (0 on padding)
    o_ik    = sum_j a_i(j) a_k(j)                       overlap of two distributions, in [0, 1]
    loss    = mean of o_ik over the pairs i < k with v(i) == v(k)

A video with one query contributes no pair; a batch without any pair gives a
zero that is still attached to the graph (so every parameter, the
temperature included, gets a gradient, as DDP requires).  The current
temperature is logged every step as the metric ``temperature``
(``train/<term>.temperature`` per epoch).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from prvrlab.data.batch import Batch
from prvrlab.checks import check_number
from prvrlab.losses._common import check_branch, query_vectors
from prvrlab.losses.base import Loss
from prvrlab.models.base import ModelOutput
from prvrlab.models.component import FRAME_TOKENS, QUERY_GROUPS
from prvrlab.registry import LOSSES


def frame_attention(vectors: Tensor, frames: Tensor, frame_mask: Tensor, query_video: Tensor, tau: Tensor) -> Tensor:
    """(Nq, Lf) attention of every query over the real frames of its own video.

    ``vectors`` (Nq, D), ``frames`` (Nv, Lf, D), ``frame_mask`` (Nv, Lf) bool,
    ``query_video`` (Nq,), ``tau`` a scalar tensor.  Rows sum to 1 (0 for a
    video without real frames); padding frames get exactly 0.
    """
    q = F.normalize(vectors.float(), dim=-1)  # (Nq, D)
    f = F.normalize(frames.float(), dim=-1)  # (Nv, Lf, D)
    own = f[query_video]  # (Nq, Lf, D): the frames of each query's video
    mask = frame_mask[query_video]  # (Nq, Lf)
    logits = torch.einsum("qd,qld->ql", q, own) / tau  # (Nq, Lf)
    logits = logits.masked_fill(~mask, float("-inf"))
    peak = logits.amax(dim=1, keepdim=True).clamp(min=torch.finfo(logits.dtype).min)  # finite on all-padding rows
    weights = torch.exp(logits - peak) * mask  # exp(-inf) = 0 on padding
    return weights / weights.sum(dim=1, keepdim=True).clamp(min=1e-12)


def pair_overlap(attention: Tensor, query_video: Tensor) -> Tensor:
    """Mean of sum_j a_i(j) a_k(j) over pairs i < k of the same video (a graph-attached 0 without pairs)."""
    overlap = attention @ attention.t()  # (Nq, Nq); only same-video entries are meaningful
    same = query_video[:, None] == query_video[None, :]  # (Nq, Nq)
    pairs = torch.triu(same, diagonal=1)  # i < k, same video
    # Without pairs: 0 / 1, still a function of the attention (hence of the temperature).
    return (overlap * pairs).sum() / pairs.sum().clamp(min=1)


@LOSSES.register("moment_coverage")
class MomentCoverageLoss(Loss):
    """Penalise the frame-attention overlap of queries of the same video (learnable temperature).

    ``branch``: the query vector used (``out.query.vectors[branch]``; the
    frame branch by default, ``video`` on ``ice_base``); ``temperature``: the
    initial softmax temperature (learned, stored as its log);
    ``min_temperature``: the floor it cannot go below.
    """

    reads_query_vectors = True

    def __init__(self, *, branch: str = "frame", temperature: float = 0.1, min_temperature: float = 0.01) -> None:
        super().__init__()
        self.branch = check_branch(branch)
        temperature = check_number(temperature, "temperature", minimum=0.0, strict=True)
        self.min_temperature = check_number(min_temperature, "min_temperature", minimum=0.0, strict=True)
        if self.min_temperature > temperature:
            raise ValueError(f"min_temperature ({min_temperature!r}) must be <= temperature ({temperature!r})")
        # A parameter of the loss: optimised, DDP-averaged and checkpointed with the model.
        self.log_temperature = nn.Parameter(torch.tensor(math.log(temperature)))

    def needs(self, *, training: bool) -> frozenset[str]:
        """Per-frame video embeddings and each video's group of queries (training only: a loss)."""
        return frozenset({FRAME_TOKENS, QUERY_GROUPS}) if training else frozenset()

    def metric_names(self) -> tuple[str, ...]:
        return ("temperature",)

    def temperature(self) -> Tensor:
        """The current temperature (a scalar tensor in the graph)."""
        return self.log_temperature.exp().clamp(min=self.min_temperature)

    def forward(self, out: ModelOutput, batch: Batch, *, epoch: int) -> Tensor:
        vectors = query_vectors(out, self.branch, "moment_coverage")  # (Nq, D)
        frames, frame_mask = out.video.frame_tokens()  # (Nv, Lf, D), (Nv, Lf)
        query_video = batch.query_video.to(frames.device)
        tau = self.temperature()
        self.log_metric("temperature", tau)
        attention = frame_attention(vectors, frames, frame_mask, query_video, tau)  # (Nq, Lf)
        return pair_overlap(attention, query_video)
