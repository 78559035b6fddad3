"""MS-SL (Dong et al., ACM MM 2022): multi-scale similarity learning for PRVR.

Query: InputProjection -> positional embedding -> one transformer layer ->
attention pooling (``Linear(D, 1)`` scores, masked softmax): one query vector
for both branches, as the reference (``modular_vector_mapping``,
``query_pooling: shared``); ``query_pooling: per_branch`` pools one vector
per branch (``Linear(D, 2)``, prvrlab before checkpoint format 8).

Clip branch: the Lc clips -> InputProjection -> positional embedding ->
transformer layer -> multi-scale sliding-window proposals: every window of
k = 1..``max_window`` consecutive clips (stride 1) averaged, i.e.
Lc (Lc + 1) / 2 = 528 proposals for 32 clips when ``max_window >= Lc``
(computed from a cumulative sum in one gather).  ``VideoEmbedding.clip``
holds the proposals (Nv, P, D), ordered by window length then start, and
``extra["clip_items"]`` the encoded clips (Nv, Lc, D); in retrieval the
proposals are left out unless a component asks for moment tokens (scoring
derives them from the items).  Clip score = max cosine over the proposals
(logits: max raw dot product).

Frame branch: frames -> InputProjection -> positional embedding ->
transformer layer (padding skipped) -> key and value maps
(``Linear(D, 2D)``, no bias).  Key-clip guided attention: for a (query,
video) pair, the proposal with the highest clip-branch cosine (the key clip)
attends over the video's real frames, ``a = softmax_j(p . key_j)`` (no
scaling, as the reference), giving ``z = sum_j a_j value_j``; frame score =
cos(frame query, z) (logits: the raw dot).  ``VideoEmbedding.frame`` holds
the values (Nv, Lf, D) with ``frame_mask``, ``extra["frame_key"]`` the keys.

The frame score depends on the pair, so :meth:`MSSL.score` computes it
batched over chunks of videos: best proposal index (Nq, C) -> gathered key
clips (Nq, C, D) -> masked attention logits (C, Nq, Lf) -> attended vectors
(C, Nq, D), with the chunk size bounding the largest of these tensors.

Retrieval reuses what does not depend on the query (same scores, float32
rounding apart): the proposals are linear in the clips (``P = A X``, ``A``
the (P, Lc) window-averaging matrix), so a query's proposal dots are its
Lc clip dots times ``A^T`` (12x fewer multiply-adds for 32 clips, in
training too); :meth:`MSSL.index_videos` (once per gallery) stores every
proposal's norm and attended frame vector, so the frame score of a pair is a
gather and a dot instead of an attention over the video's frames; on a CPU
the fused kernel of :mod:`prvrlab.models.window_best` then computes each
pair's best proposal and frame dot without the (Nq, Nv, P) proposal scores.

Training frame scores, ``frame_training`` (retrieval always scores every
pair):

* ``official`` (default; the reference's ``key_clip_guided_attention``, whose
  latest commit crashes, REFERENCE.md section 9): each query attends only in
  its own video (``QueryEmbedding.own_video``), with its own key clip, and
  the frame branch is the (Nq, Nq) matrix of query i against query j's
  attended vector, positives on the diagonal (``BranchScores.targets``).
  Another query of the same video is a negative there, as in the reference.
* ``all_pairs``: every (query, video) pair of the batch gets its true frame
  score, (Nq, Nv), as in retrieval; the other queries of a video are not
  negatives (Nq x Nv attentions instead of Nq).
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor, nn

from prvrlab.checks import check_choice, check_positive_int
from prvrlab.models import window_best
from prvrlab.models.window_best import num_proposals
from prvrlab.models.base import BranchScores, QueryEmbedding, RetrievalModel, VideoEmbedding
from prvrlab.models.blocks import (
    BackboneSizes,
    Packing,
    check_score_weights,
    legacy_encoder_keys,
    resolve_ffn_size,
)
from prvrlab.models.initialization import init_normal_
from prvrlab.models.component import FRAME_TOKENS, MOMENT_TOKENS, WORD_TOKENS
from prvrlab.models.gmm import TransformerLayer
from prvrlab.registry import BACKBONES

# Upper bound on the elements of the per-chunk tensors of MSSL.score.
_MAX_CHUNK_ELEMENTS = 1 << 26
_EPS = 1e-6


@functools.lru_cache(maxsize=64)
def _window_bounds(length: int, max_window: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """Start, end (exclusive) and length (P,) of every window of 1..max_window over ``length`` items."""
    with torch.inference_mode(False), torch.no_grad():
        starts, ends = [], []
        for k in range(1, min(max_window, length) + 1):
            s = torch.arange(0, length - k + 1, device=device)
            starts.append(s)
            ends.append(s + k)
        start = torch.cat(starts)
        end = torch.cat(ends)
        return start, end, (end - start).to(torch.float32)


@functools.lru_cache(maxsize=64)
def _window_matrix(length: int, max_window: int, device: torch.device) -> Tensor:
    """(P, length) float32: row p averages the items of window p (``1 / k`` over its k items), so the
    proposals of items ``x`` (B, length, D) are ``A @ x``, in :func:`sliding_window_proposals`' order."""
    start, end, size = _window_bounds(length, max_window, device)
    with torch.inference_mode(False), torch.no_grad():
        items = torch.arange(length, device=device)  # (L,)
        inside = (items[None, :] >= start[:, None]) & (items[None, :] < end[:, None])  # (P, L)
        return inside.to(torch.float32) / size[:, None]


def sliding_window_proposals(x: Tensor, max_window: int) -> Tensor:
    """(B, L, D) -> (B, P, D): the mean of every window of k = 1..max_window consecutive items (stride 1).

    Ordered by window length, then start.  Computed in float32 from a
    cumulative sum (one subtraction per window, no loop over windows).
    """
    B, L, D = x.shape
    start, end, size = _window_bounds(L, max_window, x.device)
    with torch.autocast(device_type=x.device.type, enabled=False):
        csum = torch.cat([x.new_zeros(B, 1, D, dtype=torch.float32), x.float().cumsum(dim=1)], dim=1)  # (B, L+1, D)
        sums = csum[:, end] - csum[:, start]  # (B, P, D)
        return (sums / size[None, :, None]).to(x.dtype)  # (B, P, D)


def _attend(rows: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None) -> Tensor:
    """Key-clip guided attention: (C, R, D) key clips over (C, Lf, D) keys / values with a (C, Lf) mask ->
    (C, R, D) ``sum_j softmax_j(row . key_j) value_j`` over the real frames (unscaled, as the reference);
    a video without real frames attends to nothing (zeros)."""
    att = torch.bmm(rows, keys.transpose(1, 2))  # (C, R, Lf)
    if mask is None:
        return torch.bmm(torch.softmax(att, dim=-1), values)  # (C, R, D)
    real = mask.to(torch.bool)[:, None, :]  # (C, 1, Lf)
    att = att.masked_fill(~real, torch.finfo(att.dtype).min)
    return torch.bmm(torch.softmax(att, dim=-1) * real, values)  # (C, R, D)


class ModularPooling(nn.Module):
    """``num_vectors`` attention poolings sharing one ``Linear(D, num_vectors)`` score layer.

    (B, L, D) tokens with a (B, L) mask -> (B, num_vectors, D), or (B, D) for one vector (shared by
    every branch, :meth:`~prvrlab.models.blocks.SequenceEncoder.embed`); a row without real tokens
    pools to zero.
    """

    def __init__(self, *, hidden_size: int, num_vectors: int) -> None:
        super().__init__()
        self.score = nn.Linear(hidden_size, check_positive_int(num_vectors, "num_vectors"), bias=False)

    def forward_packed(self, x: Tensor, packing: Packing) -> Tensor:
        """(N, D) packed tokens -> (B, num_vectors, D); (B, D) for one vector."""
        logits = packing.unpack(self.score(x).float())  # (B, L, M)
        padded = packing.unpack(x)  # (B, L, D)
        if not packing.is_full:
            logits = logits.masked_fill(~packing.mask[:, :, None], torch.finfo(logits.dtype).min)
        weights = torch.softmax(logits, dim=1)  # (B, L, M)
        if not packing.is_full:
            weights = weights * packing.mask[:, :, None]
        pooled = torch.einsum("blm,bld->bmd", weights.to(padded.dtype), padded)  # (B, M, D)
        return pooled[:, 0] if pooled.shape[1] == 1 else pooled


@BACKBONES.register("mssl")
class MSSL(RetrievalModel):
    """MS-SL with a multi-scale proposal clip branch and a key-clip guided frame branch.

    ``max_window``: the longest sliding window in clips (32: all 528
    proposals of 32 clips); ``ffn_size``: width of the feed-forward sublayer
    after every attention layer (0: none, as the reference's BERT attention
    layers; None: 4 * hidden_size); ``dropout``: input, positional and
    residual dropout; ``attention_dropout``: on attention probabilities;
    ``clip_weight`` / ``frame_weight``: the branches' weights in the retrieval
    score (0.7 / 0.3; 0.5 / 0.5 on Charades, REFERENCE.md section 1);
    ``frame_training``: the training frame scores, ``official`` or
    ``all_pairs``; ``query_pooling``: ``shared`` (one query vector, the
    reference) or ``per_branch`` (module docstring).
    Encoders: ``query``, ``clip`` and ``frame`` (:class:`SequenceEncoder`).
    """

    corrected: ClassVar[dict[str, Any]] = {"frame_training": "all_pairs"}  # the `corrected` preset (docs/parity.md)

    provides = frozenset({FRAME_TOKENS, WORD_TOKENS, MOMENT_TOKENS})  # per-frame values and proposals are always per item
    legacy_keys = {
        **legacy_encoder_keys("query", layers="query_encoder", single_layer=True, pool="query_pool"),
        **legacy_encoder_keys("clip", layers="clip_encoder", single_layer=True),
        **legacy_encoder_keys("frame", layers="frame_encoder", single_layer=True),
    }

    def __init__(
        self,
        *,
        video_dim: int,
        query_dim: int,
        hidden_size: int = 384,
        num_heads: int = 4,
        dropout: float = 0.1,
        attention_dropout: float = 0.0,
        ffn_size: int | None = 0,
        max_window: int = 32,
        max_frames: int = 128,
        max_query_len: int = 30,
        clip_weight: float = 0.7,
        frame_weight: float = 0.3,
        frame_training: Literal["official", "all_pairs"] = "official",
        query_pooling: Literal["shared", "per_branch"] = "shared",
    ) -> None:
        super().__init__()
        sizes = BackboneSizes(
            video_dim=video_dim,
            query_dim=query_dim,
            hidden_size=hidden_size,
            num_heads=num_heads,
            dropout=dropout,
            attention_dropout=attention_dropout,
            max_frames=max_frames,
            max_query_len=max_query_len,
        )
        ffn = resolve_ffn_size(ffn_size, hidden_size)
        self.max_window = check_positive_int(max_window, "max_window")
        self.frame_training = check_choice(frame_training, "frame_training", ("official", "all_pairs"))
        vectors = {"shared": 1, "per_branch": 2}[check_choice(query_pooling, "query_pooling", ("shared", "per_branch"))]
        self.score_weights = check_score_weights({"clip": clip_weight, "frame": frame_weight})
        self.hidden_size, self.max_frames, self.max_query_len = hidden_size, max_frames, max_query_len

        def layer() -> TransformerLayer:
            return TransformerLayer(**sizes.layer_args, ffn_size=ffn)

        # the query head pools one vector for both branches, or one per branch: [clip, frame]
        self.query = sizes.query_encoder(layer, pool=lambda: ModularPooling(hidden_size=hidden_size, num_vectors=vectors))
        self.clip = sizes.video_encoder(layer)
        self.frame = sizes.video_encoder(layer)
        self.frame_key_value = nn.Linear(hidden_size, 2 * hidden_size, bias=False)  # [key | value]
        self.clip_parts = {"frame_key_value.weight": 2}  # the reference's two mapping_linear layers
        init_normal_(self)

    def encode_videos(self, clips: Tensor, frames: Tensor, frame_mask: Tensor) -> VideoEmbedding:
        """(B, Lc, Dv) clips, (B, Lf, Dv) frames, (B, Lf) mask -> proposals (B, P, D) (in retrieval only
        where a component asks for moment tokens), clip items (B, Lc, D), frame values/keys (B, Lf, D)."""
        items = self.clip(clips)  # (B, Lc, D)
        keep = self.training_time() or self.exposes(MOMENT_TOKENS)
        f, frame_packing = self.frame.encode(frames, frame_mask)  # (Nf, D)
        key, value = self.frame_key_value(f).chunk(2, dim=-1)  # (Nf, D) each
        return VideoEmbedding(
            clip=sliding_window_proposals(items, self.max_window) if keep else None,  # (B, P, D)
            frame=frame_packing.unpack(value),  # (B, Lf, D), zeros on padding
            frame_mask=frame_packing.mask,  # (B, Lf)
            extra={"frame_key": frame_packing.unpack(key), "clip_items": items},  # (B, Lf, D), (B, Lc, D)
        )

    def encode_queries(self, queries: Tensor, query_mask: Tensor) -> QueryEmbedding:
        """(Nq, Lq, Dq) tokens with (Nq, Lq) mask -> clip and frame query vectors (Nq, D) each."""
        return self.query.embed(
            queries, query_mask, branches=("clip", "frame"), keep_tokens=self.keeps_word_tokens()
        )

    def _sizes(self, video: VideoEmbedding) -> tuple[int, int, int]:
        """(Nv, P, D) of the proposals, stored or not."""
        if video.clip is not None:
            nv, num_props, dim = video.clip.shape
            return nv, num_props, dim
        nv, length, dim = video.extra["clip_items"].shape
        return nv, num_proposals(length, self.max_window), dim

    def _proposals(self, video: VideoEmbedding, start: int, stop: int) -> Tensor:
        """(C, P, D) float32 proposals of videos [start, stop): the stored ones, else the clip items'
        window means."""
        if video.clip is not None:
            return video.clip[start:stop].float()
        items = video.extra["clip_items"][start:stop].float()  # (C, Lc, D)
        return torch.matmul(_window_matrix(items.shape[1], self.max_window, items.device), items)  # (C, P, D)

    def score_elements(self, video: VideoEmbedding) -> int:
        """Per query: its branch scores against every video and their sums, about 8 floats a video;
        :meth:`score` bounds its per-chunk tensors by its video chunk (``_MAX_CHUNK_ELEMENTS``), not by
        the number of queries."""
        return 8 * self._sizes(video)[0]

    def index_videos(self, video: VideoEmbedding) -> VideoEmbedding:
        """Adds every proposal's norm and, where memory allows, every proposal's attended frame vector.

        ``extra["proposal_norm"]`` (Nv, P); ``extra["attended"]`` (Nv, P, D): for every proposal p of a
        video the unit vector of ``z_p = sum_j softmax_j(p . key_j) value_j``, with ``attended_norm``
        (Nv, P) its norm -- the frame branch's vector for every (query, video) pair whose key clip is p,
        computed once per proposal (Nv P Lf D work instead of Nq Nv Lf D per gallery), so scoring
        gathers it instead of attending.  ``frame_key`` is dropped once ``attended`` is there, and
        ``extra["finite"]`` (Nv,) marks the videos whose values are all finite (what the fused kernel
        may take).  The attended vectors are left out (scoring attends per pair) where they would take
        more than a quarter of the free memory.  An indexed gallery is returned as it is.
        """
        from prvrlab.data.resident import available_bytes

        if "proposal_norm" in video.extra or video.frame is None or "frame_key" not in video.extra:
            return video
        if video.clip is None and "clip_items" not in video.extra:
            return video
        nv, num_props, dim = self._sizes(video)
        length = video.frame.shape[1]
        device = video.frame.device
        free = available_bytes(device)
        attend = free is None or 4 * nv * num_props * dim <= free // 4
        chunk = max(1, _MAX_CHUNK_ELEMENTS // max(1, num_props * (length + 2 * dim)))
        p_norm = torch.empty((nv, num_props), dtype=torch.float32, device=device)  # (Nv, P)
        unit = torch.empty((nv, num_props, dim) if attend else (0,), dtype=torch.float32, device=device)
        norm = torch.empty((nv, num_props) if attend else (0,), dtype=torch.float32, device=device)
        with torch.autocast(device_type=device.type, enabled=False):
            for start in range(0, nv, chunk):
                stop = min(start + chunk, nv)
                props = self._proposals(video, start, stop)  # (C, P, D)
                torch.clamp(props.norm(dim=-1), min=_EPS, out=p_norm[start:stop])
                if not attend:
                    continue
                keys = video.extra["frame_key"][start:stop].float()  # (C, Lf, D)
                mask = None if video.frame_mask is None else video.frame_mask[start:stop]
                z = _attend(props, keys, video.frame[start:stop].float(), mask)  # (C, P, D)
                torch.clamp(z.norm(dim=-1), min=_EPS, out=norm[start:stop])
                torch.div(z, norm[start:stop, :, None], out=unit[start:stop])
        extra = {**video.extra, "proposal_norm": p_norm}
        if not attend:
            return replace(video, extra=extra)
        extra["attended"], extra["attended_norm"] = unit, norm
        del extra["frame_key"]
        finite = torch.isfinite(norm).all(dim=1) & torch.isfinite(p_norm).all(dim=1)  # (Nv,)
        if "clip_items" in extra:
            finite &= torch.isfinite(extra["clip_items"]).flatten(1).all(dim=1)
        extra["finite"] = finite
        return replace(video, extra=extra)

    def score(
        self, query: QueryEmbedding, video: VideoEmbedding, *, with_logits: bool = False
    ) -> dict[str, BranchScores]:
        """Clip: max over proposals; frame: key-clip guided attention (cosine; logits: raw dots). fp32.

        Proposal dots come from the clip items' dots through the window matrix where
        ``extra["clip_items"]`` is there (``q . A x = (q . x) A^T``: Lc, not P, dots of length D per
        pair); the frame branch reads :meth:`index_videos`' attended vectors where they are there.
        With ``frame_training: official`` and the queries' own videos known (the training forward),
        the frame branch is the (Nq, Nq) own-video matrix of the module docstring.
        """
        indexed = "attended" in video.extra
        items = video.extra.get("clip_items")
        if (video.clip is None and items is None) or video.frame is None or not (indexed or "frame_key" in video.extra):
            raise ValueError(
                "MSSL.score needs the proposals (VideoEmbedding.clip) or extra['clip_items'], .frame and "
                "extra['frame_key']"
            )
        q_clip, q_frame = query.vectors["clip"], query.vectors["frame"]
        nq = q_clip.shape[0]
        nv, num_props, dim = self._sizes(video)
        length = video.frame.shape[1]
        if nv == 0 or num_props == 0 or length == 0:
            empty = q_clip.new_full((nq, nv), -1.0, dtype=torch.float32)  # (Nq, Nv)
            out = BranchScores(sim=empty, logits=empty.clone() if with_logits else None)
            return {"clip": out, "frame": BranchScores(sim=empty.clone(), logits=out.logits)}
        window = None
        if items is not None and items.dim() == 3:
            window = _window_matrix(items.shape[1], self.max_window, items.device)  # (P, Lc)
            window = window if window.shape[0] == num_props else None
        prop_norm = video.extra.get("proposal_norm")
        own = query.own_video if self.frame_training == "official" and not indexed else None  # training never indexes
        bests: list[Tensor] = []  # (Nq, C) key clip of every pair, for the own-video frame branch
        per_video = max(1, nq * (num_props + length + 2 * dim))
        chunk = max(1, _MAX_CHUNK_ELEMENTS // per_video)
        parts: dict[str, list[Tensor]] = {"clip_sim": [], "clip_logit": [], "frame_sim": [], "frame_logit": []}
        with torch.autocast(device_type=q_clip.device.type, enabled=False):
            qc = q_clip.float()  # (Nq, D)
            qf = q_frame.float()  # (Nq, D)
            qc_norm = qc.norm(dim=-1).clamp(min=_EPS)  # (Nq,)
            qf_norm = qf.norm(dim=-1).clamp(min=_EPS)  # (Nq,)
            mask_all = video.frame_mask
            # retrieval of an indexed gallery on a CPU: the fused kernel (window_best) where it can be had
            fused = (
                not with_logits and indexed and window is not None and "finite" in video.extra
                and window_best.usable(qc, qf) and bool(video.extra["finite"].all())
            )
            for start in range(0, nv, chunk):
                stop = min(start + chunk, nv)
                c = stop - start
                props = None if prop_norm is not None and window is not None else self._proposals(video, start, stop)
                if prop_norm is not None:
                    p_norm = prop_norm[start:stop].float()  # (C, P)
                else:
                    p_norm = props.norm(dim=-1).clamp(min=_EPS)  # (C, P)
                if window is not None and not with_logits:  # retrieval: 1/|p| folded into each video's window
                    item_dots = (qc @ items[start:stop].float().reshape(-1, dim).t()).view(nq, c, -1)
                    if fused and bool(torch.isfinite(item_dots).all()):
                        scale = window.amax(dim=1)[None] / p_norm  # (C, P): 1 / (k |p|)
                        unit = video.extra["attended"][start:stop]  # (C, P, D)
                        top, _, f_unit = window_best.window_best(item_dots, scale, self.max_window, unit, qf)
                        parts["clip_sim"].append(top / qc_norm[:, None])  # (Nq, C)
                        parts["frame_sim"].append(f_unit / qf_norm[:, None])  # (Nq, C)
                        continue
                    scaled = window[None] / p_norm[:, :, None]  # (C, P, Lc)
                    top, best = torch.bmm(item_dots.transpose(0, 1), scaled.transpose(1, 2)).max(dim=-1)  # (C, Nq)
                    clip_sim, best = top.t() / qc_norm[:, None], best.t()  # (Nq, C) each
                else:
                    if window is not None:
                        it = items[start:stop].float()  # (C, Lc, D)
                        item_dots = (qc @ it.reshape(-1, dim).t()).view(nq * c, -1)  # (Nq C, Lc)
                        dots = (item_dots @ window.t()).view(nq, c, num_props)  # (Nq, C, P)
                    else:
                        dots = (qc @ props.reshape(c * num_props, dim).t()).view(nq, c, num_props)  # (Nq, C, P)
                    cos = dots / (qc_norm[:, None, None] * p_norm[None])  # (Nq, C, P)
                    clip_sim, best = cos.max(dim=-1)  # (Nq, C) each
                    if with_logits:
                        parts["clip_logit"].append(dots.amax(dim=-1))  # (Nq, C)
                parts["clip_sim"].append(clip_sim)
                if own is not None:
                    bests.append(best)
                    continue
                videos = torch.arange(c, device=qc.device)[None, :].expand(nq, c)  # (Nq, C)
                if indexed:  # the key clip's attended vector, computed once per proposal
                    unit = video.extra["attended"][start:stop].float()[videos, best]  # (Nq, C, D)
                    f_unit = torch.bmm(unit, qf[:, :, None]).squeeze(-1)  # (Nq, C)
                    parts["frame_sim"].append(f_unit / qf_norm[:, None])
                    if with_logits:
                        norm = video.extra["attended_norm"][start:stop].float()[videos, best]  # (Nq, C)
                        parts["frame_logit"].append(f_unit * norm)
                    continue
                if props is None:
                    props = self._proposals(video, start, stop)  # (C, P, D)
                # key clip of every (query, video) pair
                key_clip = props[videos, best].transpose(0, 1)  # (C, Nq, D)
                keys = video.extra["frame_key"][start:stop].float()  # (C, Lf, D)
                values = video.frame[start:stop].float()  # (C, Lf, D)
                mask = None if mask_all is None else mask_all[start:stop]
                attended = _attend(key_clip, keys, values, mask)  # (C, Nq, D)
                f_dots = (attended * qf[None]).sum(dim=-1).t()  # (Nq, C)
                f_norm = attended.norm(dim=-1).clamp(min=_EPS).t()  # (Nq, C)
                parts["frame_sim"].append(f_dots / (qf_norm[:, None] * f_norm))  # (Nq, C)
                if with_logits:
                    parts["frame_logit"].append(f_dots)

        def cat(name: str) -> Tensor | None:
            if not parts[name]:
                return None
            return parts[name][0] if len(parts[name]) == 1 else torch.cat(parts[name], dim=1)  # (Nq, Nv)

        clip = BranchScores(sim=cat("clip_sim"), logits=cat("clip_logit"))
        if own is not None:
            frame = self._own_video_scores(video, qf, own, torch.cat(bests, dim=1), with_logits=with_logits)
            return {"clip": clip, "frame": frame}
        return {"clip": clip, "frame": BranchScores(sim=cat("frame_sim"), logits=cat("frame_logit"))}

    def _own_video_scores(
        self, video: VideoEmbedding, q_frame: Tensor, own: Tensor, best: Tensor, *, with_logits: bool
    ) -> BranchScores:
        """The official training frame branch: query i's key clip (its best proposal of its own video,
        ``best`` (Nq, Nv)) attends over that video's real frames -> z_i; scores (Nq, Nq) of query i
        against z_j, positives on the diagonal."""
        nq = q_frame.shape[0]
        rows = torch.arange(nq, device=q_frame.device)
        own = own.to(q_frame.device)
        key_index = best[rows, own]  # (Nq,)
        with torch.autocast(device_type=q_frame.device.type, enabled=False):
            if video.clip is not None:
                key_clip = video.clip[own, key_index].float()  # (Nq, D)
            else:
                items = video.extra["clip_items"][own].float()  # (Nq, Lc, D)
                window = _window_matrix(items.shape[1], self.max_window, items.device)[key_index]  # (Nq, Lc)
                key_clip = torch.bmm(window[:, None], items)[:, 0]  # (Nq, D)
            mask = None if video.frame_mask is None else video.frame_mask[own]  # (Nq, Lf)
            keys = video.extra["frame_key"][own].float()  # (Nq, Lf, D)
            attended = _attend(key_clip[:, None], keys, video.frame[own].float(), mask)[:, 0]  # (Nq, D)
            dots = q_frame @ attended.t()  # (Nq, Nq)
            norms = q_frame.norm(dim=-1).clamp(min=_EPS)[:, None] * attended.norm(dim=-1).clamp(min=_EPS)[None]
        return BranchScores(sim=dots / norms, logits=dots if with_logits else None, targets=rows)
