"""GMMFormer v2's optimal-matching loss: a one-to-one assignment of a video's queries to its clips.

For every video v of the batch with M_v >= 2 queries, with
``pi_ij = cos(q_i, c_j)`` between its queries ``out.query.vectors[branch]``
and its clip embeddings ``out.video.clip[v]`` (Lc, D), the Hungarian
algorithm (``scipy.optimize.linear_sum_assignment``, maximising) finds the
assignment A* giving each query a distinct clip with the largest total
cosine (Eq. 6); then::

    loss = mean over all assigned (i, j) pairs of the batch of (1 - pi_ij)

i.e. the reference code's reduction (``reduction: pair``: one mean over the
pairs of all videos, so a video weighs in proportion to its queries).
``reduction: video`` is the paper's Eq. 7, ``1/M_v sum_ij (1 - pi_ij) a*_ij``
per video, then the mean over the videos with >= 2 queries (every video
weighs the same).  The assignment is not differentiated; the gradient
flows through the assigned cosines.  A video with more queries than clips
(M_v > Lc) gets a rectangular problem: only Lc of its queries are assigned
(the ones the solver picks) and the others are left out of the loss.  When
no video has two queries the loss is 0, still attached to the graph.

Cost on an accelerator: the per-video cosine matrices are computed in one
batched product on padded (B, M_max, Lc) query slots and copied to the host
once, the host's one wait per step; ``query_video`` is read from the batch's
host copy (to size the padding).  The solver runs on the host, then the
assigned cosines are gathered on the device with index tensors sent through
page-locked memory (no wait).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from prvrlab.checks import check_choice
from prvrlab.data.batch import Batch, host_to_device
from prvrlab.losses._common import check_branch, query_vectors
from prvrlab.losses.base import Loss
from prvrlab.models.base import ModelOutput
from prvrlab.models.component import MOMENT_TOKENS, QUERY_GROUPS
from prvrlab.registry import LOSSES


def group_queries(query_video: np.ndarray, num_videos: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-video query counts (B,) and each query's slot (its rank among its video's queries), (Nq,)."""
    counts = np.bincount(query_video, minlength=num_videos)  # (B,)
    order = np.argsort(query_video, kind="stable")  # (Nq,)
    first = np.cumsum(counts) - counts  # (B,) position of each video's first query in `order`
    slot = np.empty_like(query_video)
    slot[order] = np.arange(query_video.shape[0]) - first[query_video[order]]
    return counts, slot


def matching_cosines(vectors: Tensor, clips: Tensor, query_video: Tensor | np.ndarray) -> tuple[Tensor, Tensor] | None:
    """The assigned (query, clip) cosines (P,) with grad and their query indices (P,); None if no video has 2 queries.

    ``vectors`` (Nq, D), ``clips`` (B, Lc, D), ``query_video`` (Nq,) long, on the host (a NumPy array) or a tensor.
    """
    nq = vectors.shape[0]
    num_videos, num_clips, _ = clips.shape
    if isinstance(query_video, Tensor):
        query_video = query_video.detach().cpu().numpy()  # a wait on a GPU: pass the batch's host copy instead
    qv = np.asarray(query_video, dtype=np.int64)  # (Nq,)
    counts, slot = group_queries(qv, num_videos)
    if nq == 0 or num_clips == 0 or counts.max(initial=0) < 2:
        return None
    width = int(counts.max())
    device = vectors.device
    video_idx, slot_idx = host_to_device(np.stack([qv, slot]), device)  # (Nq,) each
    with torch.autocast(device_type=device.type, enabled=False):
        q = F.normalize(vectors.float(), dim=-1)  # (Nq, D)
        c = F.normalize(clips.float(), dim=-1)  # (B, Lc, D)
        padded = q.new_zeros(num_videos, width, q.shape[1])  # (B, M_max, D)
        padded = padded.index_put((video_idx, slot_idx), q)
        cos = torch.bmm(padded, c.transpose(1, 2))  # (B, M_max, Lc)
    from scipy.optimize import linear_sum_assignment  # here: config checks load every loss module, scipy.optimize takes ~0.5 s

    host = cos.detach().cpu().numpy()  # the one wait: every cost matrix at once
    vids, rows, cols = [], [], []
    for v in np.flatnonzero(counts >= 2):
        r, k = linear_sum_assignment(host[v, : counts[v]], maximize=True)
        vids.append(np.full(r.shape[0], v))
        rows.append(r)
        cols.append(k)
    v_a, r_a, k_a = np.concatenate(vids), np.concatenate(rows), np.concatenate(cols)  # (P,) each
    query_of = np.full((num_videos, width), -1, dtype=np.int64)  # (B, M_max): the query in each (video, slot)
    query_of[qv, slot] = np.arange(nq)
    v_t, r_t, k_t, queries = host_to_device(np.stack([v_a, r_a, k_a, query_of[v_a, r_a]]), device)  # (P,) each
    return cos[v_t, r_t, k_t], queries


@LOSSES.register("optimal_matching")
class OptimalMatchingLoss(Loss):
    """Optimal-matching loss of GMMFormer v2 between ``out.query.vectors[branch]`` and ``out.video.clip``;
    ``reduction``: ``pair`` (the reference code) or ``video`` (the paper's Eq. 7), see the module docstring."""

    reads_query_vectors = True

    def __init__(self, *, branch: str = "clip", reduction: Literal["pair", "video"] = "pair") -> None:
        super().__init__()
        self.branch = check_branch(branch)
        self.reduction = check_choice(reduction, "reduction", ("pair", "video"))

    def needs(self, *, training: bool) -> frozenset[str]:
        """Each video's clip (moment) embeddings and its group of queries."""
        return frozenset({MOMENT_TOKENS, QUERY_GROUPS})

    def forward(self, out: ModelOutput, batch: Batch, *, epoch: int) -> Tensor:
        vectors = query_vectors(out, self.branch, "optimal_matching")  # (Nq, D)
        clips, _ = out.video.moment_tokens()  # (B, Lc, D)
        query_video = batch.host_query_video()  # (Nq,)
        result = matching_cosines(vectors, clips, query_video)
        if result is None:
            return (vectors.sum() + clips.sum()).float() * 0.0
        assigned, queries = result  # (P,) each
        if self.reduction == "pair":
            return (1.0 - assigned).mean()
        counts = np.bincount(query_video, minlength=clips.shape[0])  # (B,) M_v
        share = 1.0 / (counts[query_video] * np.count_nonzero(counts >= 2))  # (Nq,) 1 / (M_v * videos with pairs)
        return ((1.0 - assigned) * host_to_device(share.astype(np.float32), assigned.device)[queries]).sum()
