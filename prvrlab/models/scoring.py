"""Batched query-video scoring shared by the backbones.

Scores are computed in fp32 with autocast disabled, as one matrix product per
chunk of videos (never a Python loop over queries or videos); where bf16 autocast
made the embeddings, those products run on the CPU's bf16 units with float32 sums.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import Tensor

from prvrlab.models import winners
from prvrlab.models.base import BranchScores, VideoEmbedding, tensors_of
from prvrlab.models.precision import bf16_exact, bf16_products

# Upper bound on the (Nq, chunk, L) score tensor built at once (elements).
_MAX_CHUNK_ELEMENTS = 1 << 26
# The same at retrieval on a CPU, where a block's scores are reduced while in the caches (8 MiB).
_RETRIEVAL_BLOCK_ELEMENTS = 1 << 21
# Elements per piece where a bf16 gallery is read in float32 at indexing (never a float32 copy of all of
# it): 4 MiB.  256 videos a piece (50 MB of v2's frames at TVR's test size) left each freed piece split
# by the small results allocated after it, so the next piece took new memory: +0.09-0.25 GiB resident.
_INDEX_PIECE_ELEMENTS = 1 << 20
_EPS = 1e-6


class _Dots(torch.autograd.Function):
    """``q @ vᵀ`` of float32 (Nq, D) and (M, D) -> (Nq, M), forward and backward on the CPU's bf16 units
    where ``units`` (:func:`~prvrlab.models.precision.bf16_products`; elsewhere and without such units plain
    float32 products).  For ``q`` and ``v`` that hold bf16 values (bf16 autocast encoded them) the forward
    is exact products with float32 sums, as in float32; the backward rounds the incoming (Nq, M) gradient to
    bf16 once, as autocast's own bf16 products do, before float32 sums.  v2's frame scores, 640 queries x
    16,384 frames x 384 on AMX: 21 -> 6 ms forward, 42 -> 14 ms backward."""

    @staticmethod
    def forward(ctx, q: Tensor, v: Tensor, units: bool) -> Tensor:
        ctx.save_for_backward(q, v)
        ctx.units = units
        with bf16_products(units):
            return q @ v.t()  # (Nq, M)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        q, v = ctx.saved_tensors
        need_q, need_v, _ = ctx.needs_input_grad
        with bf16_products(ctx.units):
            gq = g @ v if need_q else None  # (Nq, D)
            gv = g.t() @ q if need_v else None  # (M, D)
        return gq, gv, None


def vector_scores(query: Tensor, video: Tensor, *, with_logits: bool = False) -> BranchScores:
    """Cosine (and raw dot) scores of (Nq, D) queries against (Nv, D) video vectors."""
    with torch.autocast(device_type=query.device.type, enabled=False):
        q = query.float()  # (Nq, D)
        v = video.float()  # (Nv, D)
        dots = q @ v.t()  # (Nq, Nv)
        norms = q.norm(dim=-1).clamp(min=_EPS)[:, None] * v.norm(dim=-1).clamp(min=_EPS)[None, :]  # (Nq, Nv)
        return BranchScores(sim=dots / norms, logits=dots if with_logits else None)


def _index_pieces(video: Tensor) -> range:
    """Starts of the pieces of videos read in float32 at once (:data:`_INDEX_PIECE_ELEMENTS` each)."""
    per_video = max(1, video[0].numel()) if len(video) else 1
    return range(0, len(video), max(1, _INDEX_PIECE_ELEMENTS // per_video))


def token_norms(video: Tensor) -> Tensor:
    """(Nv, L, D) vectors -> (Nv, L) float32 norms, clamped as :func:`max_scores` divides by them
    (of a bf16 ``video``, a piece of :data:`_INDEX_PIECE_ELEMENTS` at a time, into one result)."""
    with torch.autocast(device_type=video.device.type, enabled=False):
        pieces = _index_pieces(video)
        if video.dtype == torch.float32 or len(pieces) <= 1:
            return video.float().norm(dim=-1).clamp(min=_EPS)
        out = torch.empty(video.shape[:2], dtype=torch.float32, device=video.device)  # (Nv, L)
        for i in pieces:
            out[i : i + pieces.step] = video[i : i + pieces.step].float().norm(dim=-1).clamp(min=_EPS)
        return out


def index_token_norms(video: VideoEmbedding, names: Sequence[str]) -> VideoEmbedding:
    """``video`` with ``extra["<name>_norm"]`` = :func:`token_norms` of each (Nv, L, D) field ``name``:
    computed once per gallery (``RetrievalModel.index_videos``) instead of once per query chunk, where
    they cost as much memory traffic as the score product itself (GMMFormer v2's frames at TVR's test
    size: 0.4 GB read per chunk).  A field whose values are all bf16 values (encoded under bf16
    autocast) is kept in bf16: half the memory, the same values, and :func:`max_scores` then multiplies
    it on the bf16 units (a backbone that lists the field in ``low_precision_fields`` gets it in bf16
    from evaluation already).  An indexed gallery is returned as it is."""
    extra = dict(video.extra)
    fields: dict[str, Tensor] = {}
    for name in names:
        field = getattr(video, name)
        if f"{name}_norm" not in extra and field is not None and field.dim() == 3:
            extra[f"{name}_norm"] = token_norms(field)  # (Nv, L)
            if field.dtype == torch.float32:
                low = field.to(torch.bfloat16)  # (Nv, L, D)
                pieces = _index_pieces(field)
                if all(torch.equal(low[i : i + pieces.step].float(), field[i : i + pieces.step]) for i in pieces):
                    fields[name] = low  # the same values
    return video if extra.keys() == video.extra.keys() else replace(video, extra=extra, **fields)


def indexed_norms(video: VideoEmbedding, name: str) -> Tensor | None:
    """The (Nv, L) norms :func:`index_token_norms` stored for field ``name``, or None (not indexed)."""
    return video.extra.get(f"{name}_norm")


def indexed_score_elements(video: VideoEmbedding) -> int:
    """``RetrievalModel.score_elements`` of a backbone whose retrieval branches are :func:`max_scores`
    and :func:`vector_scores`: 8 float32 values a video per query (each branch's (Nq, Nv) scores, the
    vector branch's dots and norms, their weighted sum).  Per-token scores exist only in blocks of
    :data:`_RETRIEVAL_BLOCK_ELEMENTS`, whatever the number of queries, so evaluation scores ~2,000
    queries per pass over the gallery instead of ~100."""
    return 8 * int(tensors_of(video)[0].shape[0])


def max_scores(
    query: Tensor,
    video: Tensor,
    mask: Tensor | None = None,
    *,
    with_logits: bool = False,
    video_norm: Tensor | None = None,
) -> BranchScores:
    """Max over each video's vectors of the cosine (and, separately, of the raw dot).

    ``query`` (Nq, D); ``video`` (Nv, L, D) with an optional (Nv, L) mask whose
    False positions never win the max (a video without real vectors scores -1
    in ``sim`` and its min-float in ``logits``).  ``video_norm``: the (Nv, L)
    :func:`token_norms` of ``video`` where they were computed beforehand (same
    scores, bit for bit).
    """
    nq = query.shape[0]
    nv, length, dim = video.shape
    if nv == 0 or length == 0:
        empty = query.new_full((nq, nv), -1.0, dtype=torch.float32)  # (Nq, Nv)
        return BranchScores(sim=empty, logits=empty.clone() if with_logits else None)
    in_place = not (torch.is_grad_enabled() and (query.requires_grad or video.requires_grad))  # retrieval
    if in_place and not with_logits:
        return BranchScores(sim=_retrieval_max_cosine(query, video, mask, video_norm))
    chunk = max(1, _MAX_CHUNK_ELEMENTS // max(1, nq * length))
    sims, logits = [], []
    units = query.dtype == video.dtype == torch.bfloat16  # bf16 values: exact products on bf16 units (_Dots)
    with torch.autocast(device_type=query.device.type, enabled=False):
        q = query.float()  # (Nq, D)
        q_norm = q.norm(dim=-1).clamp(min=_EPS)  # (Nq,)
        for start in range(0, nv, chunk):
            v = video[start : start + chunk].float()  # (C, L, D)
            c = v.shape[0]
            flat = v.reshape(c * length, dim)  # (C L, D)
            dots = (q @ flat.t() if in_place else _Dots.apply(q, flat, units)).view(nq, c, length)  # (Nq, C, L)
            v_norm = token_norms(v) if video_norm is None else video_norm[start : start + chunk]  # (C, L)
            pad = None if mask is None else ~mask[start : start + chunk].to(torch.bool)[None]  # (1, C, L)
            if in_place:
                cos = dots / (q_norm[:, None, None] * v_norm[None])  # (Nq, C, L); dots stays for the logits
                if pad is not None:
                    cos.masked_fill_(pad, -1.0)
                    dots.masked_fill_(pad, torch.finfo(dots.dtype).min)
                sims.append(cos.amax(dim=-1))  # (Nq, C)
                logits.append(dots.amax(dim=-1))  # (Nq, C)
                continue
            sim, logit = _max_at_winners(dots, q_norm, v_norm, pad, with_logits)
            sims.append(sim)
            if with_logits:
                logits.append(logit)
        sim = sims[0] if len(sims) == 1 else torch.cat(sims, dim=1)  # (Nq, Nv)
        if not with_logits:
            return BranchScores(sim=sim)
        logit = logits[0] if len(logits) == 1 else torch.cat(logits, dim=1)  # (Nq, Nv)
        return BranchScores(sim=sim, logits=logit)


def _max_at_winners(
    dots: Tensor, q_norm: Tensor, v_norm: Tensor, pad: Tensor | None, with_logits: bool
) -> tuple[Tensor, Tensor | None]:
    """The max over L of the cosine ``dots / (q_norm * v_norm)`` and (``with_logits``) of ``dots`` itself,
    padding never winning, each taken at its winner found without autograd: the gradient reaches only the
    (Nq, C) winning dots and norms, not every (Nq, C, L) element through the division, masking and max
    (the same values, bit for bit; between exactly tied maxima the gradient goes to the first, where
    ``amax`` would share it).  ``dots`` (Nq, C, L), ``q_norm`` (Nq,), ``v_norm`` (C, L), ``pad`` (1, C, L)."""
    nq, c, _ = dots.shape
    with torch.no_grad():
        found = winners.winners(dots, q_norm, v_norm, pad, with_logits)  # (Nq, C, 1 or 2); one pass on a CPU
        if found is None:
            found = _argmax_winners(dots, q_norm, v_norm, pad, with_logits)
        real = None if pad is None else ~pad[0].all(dim=-1)  # (C,) videos with a real vector
    picked = dots.gather(2, found)  # (Nq, C, 1 or 2): one backward scatter for both
    videos = torch.arange(c, device=dots.device)[None, :]  # (1, C)
    sim = picked[..., 0] / (q_norm[:, None] * v_norm[videos, found[..., 0]])  # (Nq, C)
    logit = picked[..., 1] if with_logits else None
    if real is not None and not bool(real.all()):
        sim = sim.masked_fill(~real[None], -1.0)  # a video without a real vector: -1, no gradient
        if logit is not None:
            logit = logit.masked_fill(~real[None], torch.finfo(dots.dtype).min)
    return sim, logit


def _argmax_winners(dots: Tensor, q_norm: Tensor, v_norm: Tensor, pad: Tensor | None, with_logits: bool) -> Tensor:
    """:func:`~prvrlab.models.winners.winners` in PyTorch passes (arguments as there): (Nq, C, 1 or 2)."""
    cos = dots / (q_norm[:, None, None] * v_norm[None])  # (Nq, C, L)
    if pad is not None:
        cos.masked_fill_(pad, -torch.inf)  # below every real cosine, rounded ones under -1 included
    found = [cos.argmax(dim=-1)]  # (Nq, C)
    if with_logits:
        raw = dots.masked_fill(pad, torch.finfo(dots.dtype).min) if pad is not None else dots
        found.append(raw.argmax(dim=-1))  # (Nq, C)
    return torch.stack(found, dim=-1)


def _retrieval_max_cosine(
    query: Tensor, video: Tensor, mask: Tensor | None, video_norm: Tensor | None
) -> Tensor:
    """:func:`max_scores`' ``sim`` without autograd or logits (retrieval), the same float32 arithmetic
    in blocks of videos, on a CPU cache-sized ones (the (Nq, C, L) cosines of a block are written,
    divided and reduced while they are in the caches: :data:`_RETRIEVAL_BLOCK_ELEMENTS`).  With a
    mask, blocks hold videos of similar extent (:func:`_blocks`) and stop at their longest one: a
    gallery padded to its longest video scores no padding column beyond that.  Padded
    tokens are pushed below every cosine by adding -inf (not a masked fill: one pass fewer over the
    block) and a video with padding is floored at -1 afterwards, which is the masked fill's max.  Where
    the query and the gallery hold bf16 values (bf16 autocast encoded them), the products run on the CPU's bf16 units
    (:func:`~prvrlab.models.precision.bf16_products`): exact products, float32 sums and results."""
    nq = query.shape[0]
    nv, length, dim = video.shape
    block = _RETRIEVAL_BLOCK_ELEMENTS if query.device.type == "cpu" else _MAX_CHUNK_ELEMENTS  # a GPU: few launches
    out = torch.empty(nq, nv, dtype=torch.float32, device=query.device)  # (Nq, Nv)
    padded = None if mask is None else ~mask.to(torch.bool).all(dim=1)  # (Nv,) over the gallery's whole length
    bf16_values = query.device.type == "cpu" and video.dtype == torch.bfloat16 and bf16_exact(query)
    with torch.autocast(device_type=query.device.type, enabled=False), bf16_products(bf16_values):
        q = query.float()  # (Nq, D)
        q_norm = q.norm(dim=-1).clamp(min=_EPS)  # (Nq,)
        for videos, span in _blocks(mask, nv, length, max(1, block // max(1, nq))):
            v = video[videos, :span].float()  # (C, span, D)
            c = v.shape[0]
            v_norm = token_norms(v) if video_norm is None else video_norm[videos, :span]  # (C, span)
            cos = (q @ v.reshape(c * span, dim).t()).view(nq, c, span)  # (Nq, C, span)
            cos = cos.div_(q_norm[:, None, None] * v_norm[None])
            if mask is None:
                torch.amax(cos, dim=-1, out=out[:, videos])
                continue
            real = mask[videos, :span].to(torch.bool)  # (C, span)
            cos = cos.add_(torch.zeros(c, span, device=cos.device).masked_fill_(~real, float("-inf")))
            floor = torch.where(padded[videos], -1.0, float("-inf"))  # (C,)
            out[:, videos] = torch.maximum(cos.amax(dim=-1), floor)  # (Nq, C)
    return out


_SPAN_STEP = 16  # block lengths are multiples of this (fewer distinct product shapes, each a oneDNN primitive)


def _blocks(mask: Tensor | None, nv: int, length: int, per_block: int) -> list[tuple[slice | Tensor, int]]:
    """``(videos, span)`` blocks of at most ``per_block`` scores a query (videos x span): without a mask,
    consecutive videos over the whole length; with one, videos by decreasing extent (one past their last
    real token), each block cut at its first video's extent rounded up to :data:`_SPAN_STEP` (columns
    beyond a video's extent are padding: cutting them changes no score)."""
    if mask is None:
        c = max(1, per_block // length)
        return [(slice(start, min(start + c, nv)), length) for start in range(0, nv, c)]
    extent = (mask.to(torch.int64) * torch.arange(1, length + 1, device=mask.device)).amax(dim=1)  # (Nv,)
    order = torch.argsort(extent, descending=True, stable=True)  # (Nv,)
    longest = extent[order].tolist()
    blocks, i = [], 0
    while i < nv:
        span = min(length, max(1, -(-longest[i] // _SPAN_STEP) * _SPAN_STEP))
        c = max(1, per_block // span)
        blocks.append((order[i : i + c], span))
        i += c
    return blocks
