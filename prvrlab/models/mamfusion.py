"""MamFusion (Ying et al., 2025): GMMFormer with Mamba blocks and text-video fusion for PRVR.

Encoders as GMMFormer (:mod:`prvrlab.models.gmmformer`), with ``x + LN(Mamba(x))``
(:class:`~prvrlab.models.mamba.MambaLayer`; d_state 16, d_conv 4, expand 2)
after every GMMBlock of the clip and the frame branch (``mamba: false``: plain
GMMFormer blocks, the paper's "w/o Multi-Mamba").

Fusion, named by the direction information flows (the paper's Eq. 4 and 3,
applied in this order; the reference code calls them the other way round):

* ``t2v`` (text to video): video tokens attend to the text, ``V' = V * Attn(V -> text)``;
* ``v2t`` (video to text): text tokens attend to the fused video, ``Q' = Q * Attn(Q -> V')``.

Both are multi-head cross-attentions whose output multiplies their input
element-wise (``fusion_combine: multiply``, the reference code's combination;
``replace``: the attention output itself, as the paper's Eqs. 3-4 write it).
``fusion`` picks what attends to what:

* ``batch`` (the reference code): the pooled video vectors of the batch attend
  to the batch's sentence vectors, then the sentence vectors to the fused
  videos.  The fused sentence vector depends on the whole batch, so it is a
  training-only query vector ``query.vectors["fused"]``
  (:meth:`~prvrlab.models.base.RetrievalModel.batch_vectors`) that the
  losses naming ``branch: fused`` read (the reference: only the query-diverse
  loss); retrieval never uses it.
* ``temporal`` (the paper's text): for every (query, video) pair, the video's
  per-frame tokens attend to the query's word tokens, then the word tokens to
  the fused frames; each side is pooled with its branch's pooling head and the
  pair scores ``cos(q'_qv, v'_qv)``.  The training-only fused vector is each
  query's with its own video.

Branch ``fused`` scores the fused query: against the pooled frame vectors
(``batch``, and whenever the query carries no fused vector: retrieval then
scores the unfused query there), or per pair (``temporal``).  Its weight is 0
unless ``fusion_at_retrieval`` (``temporal`` only): then it is ``fused_weight``
and retrieval is query-conditioned, cost Nq x Nv pairs, computed in chunks of
at most ``fusion_chunk`` elements per intermediate tensor.  ``mask_padding``:
see :class:`~prvrlab.models.mamba.MambaLayer` (the scan is causal, so real
tokens are the same either way).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor, nn

from prvrlab.checks import check_bool, check_choice, check_layer_count, check_positive_int, check_probability
from prvrlab.data.batch import Batch
from prvrlab.models.base import BranchScores, QueryEmbedding, RetrievalModel, VideoEmbedding
from prvrlab.models.blocks import (
    AttentionPooling,
    BackboneSizes,
    PackedLayer,
    Packing,
    PooledFrameBackbone,
    check_score_weights,
    resolve_ffn_size,
)
from prvrlab.models.initialization import init_normal_
from prvrlab.models.component import FRAME_TOKENS, MOMENT_TOKENS, WORD_TOKENS
from prvrlab.models.gmm import (
    GMMBlock, TransformerLayer, VideoWindowLength, Window, WindowLength, parse_sigmas, video_window_spans,
)
from prvrlab.models.mamba import DEFAULT_SCAN_CHUNK, MAMBA_INITS, Mamba, MambaLayer
from prvrlab.models.scoring import vector_scores
from prvrlab.registry import BACKBONES

FUSIONS: tuple[str, ...] = ("batch", "temporal")
MAMBA_RESIDUALS: tuple[str, ...] = ("official", "zero_init", "paper")
FUSION_COMBINES: tuple[str, ...] = ("multiply", "replace")


class GMMMambaBlock(PackedLayer):
    """A GMMBlock followed, when given, by a :class:`MambaLayer`."""

    def __init__(self, *, gmm: GMMBlock, mamba: MambaLayer | None) -> None:
        super().__init__()
        self.gmm, self.mamba = gmm, mamba

    def forward_packed(self, x: Tensor, packing: Packing) -> Tensor:
        """(N, D) packed tokens -> (N, D)."""
        x = self.gmm.forward_packed(x, packing)
        return x if self.mamba is None else self.mamba.forward_packed(x, packing)


class MultiplicativeCrossAttention(nn.Module):
    """``x * W_o MultiHead(x W_q, m W_k, m W_v)``: ``x`` attends to the memory ``m``, padding keys masked
    (``multiply: false``: ``W_o MultiHead(...)`` alone, the attention output replacing ``x``).

    Leading dimensions broadcast (a (1, Nv, L, D) ``x`` against (Nq, 1, M, D)
    memory gives every pair), so the projections run once per item.
    """

    def __init__(self, *, hidden_size: int, num_heads: int, multiply: bool = True) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden_size // num_heads
        self.multiply = bool(multiply)
        self.query = nn.Linear(hidden_size, hidden_size)
        self.key_value = nn.Linear(hidden_size, 2 * hidden_size)
        self.out = nn.Linear(hidden_size, hidden_size)
        # the reference's nn.MultiheadAttention packs Q, K and V in one in-projection: one tensor to clip
        self.clip_together = (("query.weight", "key_value.weight"), ("query.bias", "key_value.bias"))

    def init_like_multihead_attention_(self) -> None:
        """``nn.MultiheadAttention``'s own start for the Q/K/V projections: its packed (3D, D) in-projection
        drawn xavier-uniform as one matrix (bound sqrt(6 / (D + 3D))), zero biases; the output
        projection is left as it is."""
        hidden = self.query.weight.shape[1]
        bound = math.sqrt(6.0 / (hidden + 3 * hidden))
        with torch.no_grad():
            for linear in (self.query, self.key_value):
                nn.init.uniform_(linear.weight, -bound, bound)
                nn.init.zeros_(linear.bias)

    def _heads(self, t: Tensor) -> Tensor:
        return t.unflatten(-1, (self.num_heads, self.head_dim)).transpose(-2, -3)  # (..., H, L, Dh)

    def forward(self, x: Tensor, memory: Tensor, memory_mask: Tensor | None = None) -> Tensor:
        """(..., L, D) with (..., M, D) memory and (..., M) mask -> (..., L, D) (leading dims broadcast)."""
        q = self._heads(self.query(x))  # (..., H, L, Dh)
        k, v = (self._heads(t) for t in self.key_value(memory).chunk(2, dim=-1))  # (..., H, M, Dh)
        logits = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)  # (..., H, L, M)
        if memory_mask is not None:
            pad = ~memory_mask.to(torch.bool)[..., None, None, :]  # (..., 1, 1, M)
            logits = logits.masked_fill(pad, torch.finfo(logits.dtype).min)
        context = torch.matmul(torch.softmax(logits, dim=-1), v)  # (..., H, L, Dh)
        attended = self.out(context.transpose(-2, -3).flatten(-2))  # (..., L, D)
        return x * attended if self.multiply else attended.expand(torch.broadcast_shapes(x.shape, attended.shape))


@BACKBONES.register("mamfusion")
class MamFusion(PooledFrameBackbone):
    """MamFusion: GMMFormer's branches with Mamba blocks, plus text-video fusion (module docstring).

    GMMFormer's parameters (:class:`~prvrlab.models.gmmformer.GMMFormer`), and:
    ``input_dropout`` (of the input projections and positional embeddings;
    None: ``dropout``, which always covers the residual branches: the
    reference's input_drop / drop),
    ``mamba`` (Mamba after every GMMBlock), ``d_state`` / ``d_conv`` /
    ``expand`` (its sizes), ``mamba_init`` (``official``: the reference's N(0, 0.02) for every
    Linear with zero biases, Mamba's included; ``mamba_ssm``: the Mamba package's own,
    :meth:`~prvrlab.models.mamba.Mamba.init_like_mamba_ssm_`), ``mamba_residual`` (``official``:
    ``x + LN(Mamba(x))`` from the first step; ``zero_init``: the LN's scale starts at 0, so every
    Mamba layer starts as the identity; ``paper``: the mixer's output alone, ``V_fm = Mamba(V_fg)`` as the
    paper's Eq. 5 writes it, no residual and no LayerNorm), ``mamba_norm_decay`` (the Mamba layers' LayerNorm gains are
    weight-decayed, as the reference's grouping by name does), ``mask_padding``, ``scan_chunk`` (the chunk
    length of the selective scan), ``scan_kernel`` (``auto``: mamba_ssm's
    CUDA kernel on GPU, the fused C++ kernel on CPU when it builds, else the
    PyTorch chunked scan; ``fused`` / ``torch`` force one:
    :mod:`prvrlab.models.mamba`); ``t2v`` / ``v2t`` (the two fusions),
    ``fusion`` (``batch`` | ``temporal``), ``fusion_combine`` (``multiply``: the attention output
    multiplies its input, the reference; ``replace``: it is the fused representation, the paper's
    Eqs. 3-4), ``fusion_at_retrieval`` and
    ``fused_weight`` (the fused branch in the retrieval score), ``fusion_chunk``
    (max elements of one intermediate tensor of the pairwise fusion), ``fusion_init``
    (``official``: the fusions' Q/K/V projections start as ``nn.MultiheadAttention``'s, which the
    reference's re-initialisation of ``nn.Linear`` never reaches; ``normal``: N(0, 0.02) like the
    rest of the model), ``query_redraw`` (the fused vector is made from a second encoding of the
    queries, another dropout draw, as the reference's ``forward`` encodes them again for the fusion;
    that vector is also the training-only ``redrawn``).
    """

    corrected: ClassVar[dict[str, Any]] = {"window": "centred", "window_length": "real", "mamba_norm_decay": False}  # the `corrected` preset (docs/parity.md)

    provides = frozenset({FRAME_TOKENS, WORD_TOKENS, MOMENT_TOKENS})

    def __init__(
        self,
        *,
        video_dim: int,
        query_dim: int,
        hidden_size: int = 384,
        num_heads: int = 4,
        dropout: float = 0.1,
        attention_dropout: float = 0.0,
        input_dropout: float | None = None,
        ffn_size: int | None = 0,
        sigmas: list[float | str] = [0.5, 1.0, 5.0, "inf"],  # noqa: B006 - never mutated
        num_gmm_blocks: int = 2,
        max_frames: int = 128,
        max_query_len: int = 30,
        clip_weight: float = 0.7,
        frame_weight: float = 0.3,
        window: Window = "official",
        window_length: VideoWindowLength = "padded",
        mamba: bool = True,
        d_state: int = 16,
        d_conv: int = 4,
        expand: int = 2,
        mamba_init: Literal["official", "mamba_ssm"] = "official",
        mamba_residual: Literal["official", "zero_init", "paper"] = "official",
        mamba_norm_decay: bool = True,
        mask_padding: bool = False,
        scan_chunk: int = DEFAULT_SCAN_CHUNK,
        scan_kernel: Literal["auto", "fused", "torch"] = "auto",
        t2v: bool = True,
        v2t: bool = True,
        fusion: Literal["batch", "temporal"] = "batch",
        fusion_combine: Literal["multiply", "replace"] = "multiply",
        fusion_at_retrieval: bool = False,
        fused_weight: float = 0.3,
        fusion_chunk: int = 1 << 24,
        fusion_init: Literal["official", "normal"] = "official",
        query_redraw: bool = False,
    ) -> None:
        super().__init__()
        sizes = BackboneSizes(
            video_dim=video_dim,
            query_dim=query_dim,
            hidden_size=hidden_size,
            num_heads=num_heads,
            dropout=dropout if input_dropout is None else input_dropout,  # the encoders' input dropout
            attention_dropout=attention_dropout,
            max_frames=max_frames,
            max_query_len=max_query_len,
        )
        self.sigmas = parse_sigmas(sigmas)
        ffn = resolve_ffn_size(ffn_size, hidden_size)
        check_layer_count(num_gmm_blocks, "num_gmm_blocks")
        clip_span, frame_span = video_window_spans(window, window_length, max_frames)
        flags = (("mamba", mamba), ("mask_padding", mask_padding), ("mamba_norm_decay", mamba_norm_decay), ("t2v", t2v),
                 ("v2t", v2t))
        for name, flag in flags:
            check_bool(flag, name)
        self.fusion = check_choice(fusion, "fusion", FUSIONS)
        self.query_redraw = check_bool(query_redraw, "query_redraw")
        check_choice(mamba_init, "mamba_init", MAMBA_INITS)
        residual = check_choice(mamba_residual, "mamba_residual", MAMBA_RESIDUALS)
        multiply = check_choice(fusion_combine, "fusion_combine", FUSION_COMBINES) == "multiply"
        if check_bool(fusion_at_retrieval, "fusion_at_retrieval") and fusion != "temporal":
            raise ValueError(
                "fusion_at_retrieval: true needs fusion: temporal (the batch fusion depends on the whole "
                "training batch, so it cannot score one query against one video)"
            )
        self.fusion_chunk = check_positive_int(fusion_chunk, "fusion_chunk")
        weights = {"clip": clip_weight, "frame": frame_weight, "fused": fused_weight}
        self.score_weights = check_score_weights(weights if fusion_at_retrieval else {**weights, "fused": 0.0})
        if fusion_at_retrieval and self.score_weights["fused"] == 0:
            raise ValueError("fused_weight must be > 0 with fusion_at_retrieval: true")
        self.hidden_size, self.max_frames, self.max_query_len = hidden_size, max_frames, max_query_len
        self.num_heads = num_heads
        self.window, self.window_length = window, window_length
        layer_args = {**sizes.layer_args, "dropout": check_probability(dropout, "dropout")}

        def block(span: WindowLength) -> GMMMambaBlock:
            gmm = GMMBlock(**layer_args, sigmas=self.sigmas, ffn_size=ffn, window=window, window_length=span)
            args = {"d_state": d_state, "d_conv": d_conv, "expand": expand, "mask_padding": mask_padding,
                    "zero_init": residual == "zero_init", "bare": residual == "paper",
                    "decay_norm_gain": mamba_norm_decay, "scan_chunk": scan_chunk, "scan_kernel": scan_kernel}
            return GMMMambaBlock(gmm=gmm, mamba=MambaLayer(hidden_size=hidden_size, **args) if mamba else None)

        def pool() -> AttentionPooling:
            return AttentionPooling(hidden_size=hidden_size)

        self.query = sizes.query_encoder(lambda: TransformerLayer(**layer_args, ffn_size=ffn), pool=pool)
        self.clip = sizes.video_encoder(lambda: block(clip_span), num_layers=num_gmm_blocks)
        self.frame = sizes.video_encoder(lambda: block(frame_span), num_layers=num_gmm_blocks, pool=pool)
        fusion_args = {"hidden_size": hidden_size, "num_heads": num_heads, "multiply": multiply}
        self.t2v = MultiplicativeCrossAttention(**fusion_args) if t2v else None
        self.v2t = MultiplicativeCrossAttention(**fusion_args) if v2t else None
        init_normal_(self)
        if check_choice(fusion_init, "fusion_init", ("official", "normal")) == "official":
            for attention in (a for a in (self.t2v, self.v2t) if a is not None):
                attention.init_like_multihead_attention_()
        if mamba_init == "mamba_ssm":
            for mixer in (m for m in self.modules() if isinstance(m, Mamba)):
                mixer.init_like_mamba_ssm_()

    @property
    def temporal(self) -> bool:
        return self.fusion == "temporal" and (self.t2v is not None or self.v2t is not None)

    def encode_clips(self, clips: Tensor) -> Tensor:
        """(B, Lc, Dv) -> (B, Lc, D)."""
        return self.clip(clips)

    def keeps_frame_tokens(self) -> bool:
        """The temporal fusion reads the per-frame tokens in every mode."""
        return self.temporal or super().keeps_frame_tokens()

    def keeps_word_tokens(self) -> bool:
        """The temporal fusion reads the word tokens in every mode."""
        return self.temporal or super().keeps_word_tokens()

    # ------------------------------------------------------------ fusion

    def _batch_fusion(self, query: Tensor, video: Tensor) -> Tensor:
        """(Nq, D) sentence vectors, (Nv, D) pooled videos of one batch -> (Nq, D) fused sentence vectors."""
        if self.t2v is not None:
            video = self.t2v(video[None], query[None])[0]  # (Nv, D): every video attends to the batch's queries
        if self.v2t is not None:
            query = self.v2t(query[None], video[None])[0]  # (Nq, D)
        return query

    def _fuse(
        self, words: Tensor, word_mask: Tensor, frames: Tensor, frame_mask: Tensor, plain: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Temporal fusion of (..., Lq, D) word tokens with (..., Lf, D) frame tokens, their masks and the
        unfused (..., D) query vectors, leading dims broadcasting to S -> fused query and video (S, D)."""
        fused_frames = frames if self.t2v is None else self.t2v(frames, words, word_mask)  # (S, Lf, D)
        shape = torch.broadcast_shapes(words.shape[:-2], frames.shape[:-2], fused_frames.shape[:-2])  # S
        fused_frames = fused_frames.expand(*shape, *frames.shape[-2:])
        frame_mask = frame_mask.expand(*shape, frame_mask.shape[-1])  # (S, Lf)
        v = self.frame.pool(fused_frames.reshape(-1, *frames.shape[-2:]), frame_mask.reshape(-1, frame_mask.shape[-1]))
        if self.v2t is None:
            return plain.expand(*shape, plain.shape[-1]), v.view(*shape, -1)
        fused_words = self.v2t(words, fused_frames, frame_mask)  # (S, Lq, D)
        word_mask = word_mask.expand(*shape, word_mask.shape[-1]).reshape(-1, word_mask.shape[-1])  # (P, Lq)
        q = self.query.pool(fused_words.reshape(-1, *words.shape[-2:]), word_mask)  # (P, D)
        return q.view(*shape, -1), v.view(*shape, -1)

    def _pair_fusion(self, query: QueryEmbedding, video: VideoEmbedding) -> tuple[Tensor, Tensor]:
        """Fused (Nq, Nv, D) query and video vectors of every (query, video) pair."""
        words, word_mask = query.word_tokens()  # (Nq, Lq, D), (Nq, Lq)
        frames, frame_mask = video.frame_tokens()  # (Nv, Lf, D), (Nv, Lf)
        plain = query.vectors["clip"][:, None]  # (Nq, 1, D)
        return self._fuse(words[:, None], word_mask[:, None], frames[None], frame_mask[None], plain)

    def _pair_chunks(self, query: QueryEmbedding, video: VideoEmbedding) -> tuple[int, int]:
        """Queries and videos per chunk so that no pairwise tensor exceeds ``fusion_chunk`` elements."""
        lq, lf = query.word_tokens()[0].shape[1], video.frame_tokens()[0].shape[1]
        d = self.hidden_size
        per_pair = max(2 * lf * d, 2 * lq * d, self.num_heads * lf * lq)  # key-value pairs, attention logits
        pairs = max(1, self.fusion_chunk // per_pair)
        nq = max(1, query.vectors["clip"].shape[0])
        per_query = min(nq, pairs)
        return per_query, max(1, pairs // per_query)

    def _pair_scores(self, query: QueryEmbedding, video: VideoEmbedding, *, with_logits: bool) -> BranchScores:
        """(Nq, Nv) cosines (and dots) of the fused pairs, in memory-bounded chunks."""
        nq, nv = query.vectors["clip"].shape[0], video.frame.shape[0]
        if nq == 0 or nv == 0:
            empty = query.vectors["clip"].new_zeros(nq, nv, dtype=torch.float32)
            return BranchScores(sim=empty, logits=empty if with_logits else None)
        per_query, per_video = self._pair_chunks(query, video)
        sims, dots = [], []
        for i in range(0, nq, per_query):
            q_part = query.index(slice(i, i + per_query))
            row_sims, row_dots = [], []
            for j in range(0, nv, per_video):
                q, v = self._pair_fusion(q_part, video.index(slice(j, j + per_video)))  # (Nq', Nv', D) each
                with torch.autocast(device_type=q.device.type, enabled=False):
                    q, v = q.float(), v.float()
                    dot = (q * v).sum(-1)  # (Nq', Nv')
                    norms = q.norm(dim=-1).clamp(min=1e-6) * v.norm(dim=-1).clamp(min=1e-6)
                row_sims.append(dot / norms)
                row_dots.append(dot)
            sims.append(torch.cat(row_sims, dim=1))
            dots.append(torch.cat(row_dots, dim=1))
        return BranchScores(sim=torch.cat(sims), logits=torch.cat(dots) if with_logits else None)

    def batch_vectors(
        self, batch: Batch, query: QueryEmbedding, video: VideoEmbedding, redrawn: QueryEmbedding | None = None
    ) -> dict[str, Tensor]:
        """The training-only fused sentence vector ``fused`` (Nq, D) (module docstring); under ``query_redraw``
        fused from the second encoding of the queries (``redrawn``, whose vector is also ``redrawn``), as the
        reference's ``forward`` fuses the ``video_query`` it encodes again."""
        out: dict[str, Tensor] = {}
        if redrawn is not None:
            query = redrawn
            out["redrawn"] = query.vectors["clip"]  # (Nq, D)
        if self.fusion == "batch":
            return {**out, "fused": self._batch_fusion(query.vectors["clip"], video.frame)}
        if not self.temporal:
            return {**out, "fused": query.vectors["clip"]}
        own = batch.query_video.to(video.frame.device)  # (Nq,)
        words, word_mask = query.word_tokens()  # (Nq, Lq, D), (Nq, Lq)
        frames, frame_mask = video.frame_tokens()  # (Nv, Lf, D), (Nv, Lf)
        fused, _ = self._fuse(words, word_mask, frames[own], frame_mask[own], query.vectors["clip"])  # (Nq, D)
        return {**out, "fused": fused}  # each query fused with its own video

    score_elements = RetrievalModel.score_elements  # the fused pairs' chunks hold more than 8 floats a video

    def score(
        self, query: QueryEmbedding, video: VideoEmbedding, *, with_logits: bool = False
    ) -> dict[str, BranchScores]:
        """GMMFormer's clip and frame branches plus ``fused`` (module docstring)."""
        scores = super().score(query, video, with_logits=with_logits)
        if self.temporal and (self.training or self.score_weights["fused"] > 0):
            scores["fused"] = self._pair_scores(query, video, with_logits=with_logits)
        else:
            fused = query.vectors.get("fused", query.vectors["clip"])
            scores["fused"] = vector_scores(fused, video.frame, with_logits=with_logits)  # (Nq, Nv)
        return scores
