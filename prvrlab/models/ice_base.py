"""The base model of the ICE / IRM / TCP paper (papers/002, Sec. 3.2).

Query: InputProjection (the paper's FC) -> positional embedding ->
``num_layers`` standard transformer layers -> additive attention pooling ->
one sentence vector q (Nq, D), shared by both branches.

Video-level branch: frames -> InputProjection -> positional embedding ->
transformer layers (padding skipped) -> additive attention pooling -> one
vector v (Nv, D); S_v = cos(v, q).

Moment-level branch: the T_m = 32 moments are the batch's clips (mean
pooling of consecutive frames, done by the data pipeline, REFERENCE.md
section 3) -> InputProjection -> positional embedding -> transformer layers
-> (Nv, T_m, D); S_m = max over moments of cos(m_i, q) (Eq. 2).

Retrieval score S = alpha * S_m + (1 - alpha) * S_v (Eq. 8) with branch
names ``"moment"`` (weight ``moment_weight`` = alpha, 0.7 in the paper) and
``"video"`` (``video_weight`` = 1 - alpha).  ``VideoEmbedding.clip`` holds the
moments and ``VideoEmbedding.frame`` the pooled video vector, so plug-ins
that read clips (e.g. the optimal-matching loss) work on the moments.
"""

from __future__ import annotations

from torch import Tensor, nn

from prvrlab.models.base import BranchScores, QueryEmbedding, RetrievalModel, VideoEmbedding
from prvrlab.models.blocks import (
    AdditiveAttentionPooling,
    InputProjection,
    Packing,
    PositionalEmbedding,
    check_backbone_sizes,
    check_positive_int,
    init_normal_,
)
from prvrlab.models.component import FRAME_TOKENS, MOMENT_TOKENS, WORD_TOKENS
from prvrlab.models.gmm import TransformerLayer
from prvrlab.models.gmmformer import check_score_weights
from prvrlab.models.gmmformer_v2 import resolve_ffn_size
from prvrlab.models.scoring import max_scores, vector_scores
from prvrlab.registry import BACKBONES


@BACKBONES.register("ice_base")
class ICEBase(RetrievalModel):
    """Video-level (pooled frames) and moment-level (max over 32 moments) branches.

    ``num_layers``: transformer layers of every encoder; ``ffn_size``: their
    feed-forward width (None: 4 * hidden_size, a standard transformer
    layer); ``moment_weight`` (alpha) / ``video_weight`` (1 - alpha): the
    branches' weights in the retrieval score (each >= 0; the paper's alpha =
    0.7; they need not sum to 1, ranking only depends on their ratio).
    """

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
        ffn_size: int | None = None,
        num_layers: int = 1,
        max_frames: int = 128,
        max_query_len: int = 30,
        moment_weight: float = 0.7,
        video_weight: float = 0.3,
    ) -> None:
        super().__init__()
        check_backbone_sizes(
            video_dim=video_dim,
            query_dim=query_dim,
            hidden_size=hidden_size,
            num_heads=num_heads,
            dropout=dropout,
            attention_dropout=attention_dropout,
        )
        ffn = resolve_ffn_size(ffn_size, hidden_size)
        check_positive_int(num_layers, "num_layers")
        self.max_frames = check_positive_int(max_frames, "max_frames")
        self.max_query_len = check_positive_int(max_query_len, "max_query_len")
        self.score_weights = check_score_weights({"moment": moment_weight, "video": video_weight})
        self.hidden_size = hidden_size

        def encoder() -> nn.ModuleList:
            return nn.ModuleList(
                TransformerLayer(
                    hidden_size=hidden_size,
                    num_heads=num_heads,
                    dropout=dropout,
                    attention_dropout=attention_dropout,
                    ffn_size=ffn,
                )
                for _ in range(num_layers)
            )

        self.query_proj = InputProjection(in_dim=query_dim, out_dim=hidden_size, dropout=dropout)
        self.query_pos = PositionalEmbedding(max_len=max_query_len, hidden_size=hidden_size, dropout=dropout)
        self.query_encoder = encoder()
        self.query_pool = AdditiveAttentionPooling(hidden_size=hidden_size)

        self.moment_proj = InputProjection(in_dim=video_dim, out_dim=hidden_size, dropout=dropout)
        self.moment_pos = PositionalEmbedding(max_len=max_frames, hidden_size=hidden_size, dropout=dropout)
        self.moment_encoder = encoder()

        self.frame_proj = InputProjection(in_dim=video_dim, out_dim=hidden_size, dropout=dropout)
        self.frame_pos = PositionalEmbedding(max_len=max_frames, hidden_size=hidden_size, dropout=dropout)
        self.frame_encoder = encoder()
        self.video_pool = AdditiveAttentionPooling(hidden_size=hidden_size)

        init_normal_(self)

    def encode_videos(self, clips: Tensor, frames: Tensor, frame_mask: Tensor) -> VideoEmbedding:
        """(B, T_m, Dv) moments (the clips), (B, Lf, Dv) frames, (B, Lf) mask -> moments (B, T_m, D), video (B, D)."""
        B, Lm, _ = clips.shape
        moment_packing = Packing.full(B, Lm, clips.device)
        m = self.moment_pos.forward_packed(self.moment_proj(moment_packing.pack(clips)), moment_packing)  # (B*Lm, D)
        for layer in self.moment_encoder:
            m = layer.forward_packed(m, moment_packing)  # (B*Lm, D)

        frame_packing = Packing.from_mask(frame_mask, B, frames.shape[1], frames.device)
        f = self.frame_pos.forward_packed(self.frame_proj(frame_packing.pack(frames)), frame_packing)  # (Nf, D)
        for layer in self.frame_encoder:
            f = layer.forward_packed(f, frame_packing)  # (Nf, D)
        video = self.video_pool.forward_packed(f, frame_packing)  # (B, D)
        extra = {}
        if self.exposes(FRAME_TOKENS):  # the video branch is pooled: per-frame embeddings only on request
            extra = {"frame_tokens": frame_packing.unpack(f), "frame_mask": frame_packing.mask}  # (B, Lf, D), (B, Lf)
        return VideoEmbedding(clip=moment_packing.unpack(m), frame=video, extra=extra)

    def encode_queries(self, queries: Tensor, query_mask: Tensor) -> QueryEmbedding:
        """(Nq, Lq, Dq) tokens with (Nq, Lq) mask -> one (Nq, D) sentence vector shared by both branches."""
        packing = Packing.from_mask(query_mask, queries.shape[0], queries.shape[1], queries.device)
        t = self.query_pos.forward_packed(self.query_proj(packing.pack(queries)), packing)  # (Nt, D)
        for layer in self.query_encoder:
            t = layer.forward_packed(t, packing)  # (Nt, D)
        vector = self.query_pool.forward_packed(t, packing)  # (Nq, D)
        return QueryEmbedding(
            vectors={"moment": vector, "video": vector}, tokens=packing.unpack(t), token_mask=packing.mask
        )

    def score(
        self, query: QueryEmbedding, video: VideoEmbedding, *, with_logits: bool = False
    ) -> dict[str, BranchScores]:
        """Moment: max over moments of cosine (logits: of the raw dot); video: cosine (logits: raw dot)."""
        if video.clip is None or video.frame is None or video.frame.dim() != 2:
            raise ValueError("ICEBase.score needs VideoEmbedding.clip (moments) and .frame (one vector per video)")
        return {
            "moment": max_scores(query.vectors["moment"], video.clip, with_logits=with_logits),  # (Nq, Nv)
            "video": vector_scores(query.vectors["video"], video.frame, with_logits=with_logits),  # (Nq, Nv)
        }
