"""GMMFormer (Wang et al., AAAI 2024): Gaussian-mixture-prior transformer for PRVR.

Query: InputProjection -> positional embedding -> one attention layer (a
plain-attention GMMBlock) -> attention pooling -> one vector shared by both
branches.  Clip branch: clips -> InputProjection -> positional embedding ->
``num_gmm_blocks`` GMMBlocks -> (B, Lc, D); score = max over clips.  Frame
branch: frames -> InputProjection -> positional embedding -> GMMBlocks
(padding skipped) -> attention pooling -> (B, D).

Differences from the reference code: dropout on the attention probabilities
is off by default (``attention_dropout=0``; the reference uses the hidden
dropout rate there) because on CPU it costs several passes over the largest
tensor of the model; Gaussian windows use each video's real length (the
reference uses the padded length, so its scores depend on the batch);
``ffn_size > 0`` adds feed-forward sublayers the reference does not have.
"""

from __future__ import annotations

import math

from torch import Tensor, nn

from prvrlab.models.base import BranchScores, QueryEmbedding, RetrievalModel, VideoEmbedding
from prvrlab.models.blocks import (
    AttentionPooling,
    InputProjection,
    Packing,
    PositionalEmbedding,
    check_backbone_sizes,
    check_positive_int,
    init_normal_,
)
from prvrlab.models.component import FRAME_TOKENS, MOMENT_TOKENS, WORD_TOKENS
from prvrlab.models.gmm import GMMBlock, TransformerLayer, parse_sigmas
from prvrlab.models.scoring import max_scores, vector_scores
from prvrlab.registry import BACKBONES


def check_score_weights(weights: dict[str, float]) -> dict[str, float]:
    """Validate branch weights (finite, >= 0, not all zero); a ValueError names the bad one."""
    for name, value in weights.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{name}_weight must be a finite number >= 0, got {value!r}")
    if all(value == 0 for value in weights.values()):
        raise ValueError(f"score weights {weights!r} are all zero; at least one branch must count")
    return {name: float(value) for name, value in weights.items()}


@BACKBONES.register("gmmformer")
class GMMFormer(RetrievalModel):
    """GMMFormer with a clip branch (max over the clips) and a pooled frame branch.

    ``sigmas``: widths of the Gaussian branches of every GMMBlock (``"inf"`` or
    float inf: plain attention); ``num_gmm_blocks`` blocks per video branch;
    ``dropout``: input, positional and residual dropout; ``attention_dropout``:
    on attention probabilities; ``ffn_size``: feed-forward width after every
    attention layer (0: none, as the reference); ``clip_weight`` /
    ``frame_weight``: the branches' weights in the retrieval score.
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
        ffn_size: int = 0,
        sigmas: list[float | str] = [0.5, 1.0, 5.0, "inf"],  # noqa: B006 - never mutated
        num_gmm_blocks: int = 2,
        max_frames: int = 128,
        max_query_len: int = 30,
        clip_weight: float = 0.7,
        frame_weight: float = 0.3,
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
        self.sigmas = parse_sigmas(sigmas)
        check_positive_int(num_gmm_blocks, "num_gmm_blocks")
        self.max_frames = check_positive_int(max_frames, "max_frames")
        self.max_query_len = check_positive_int(max_query_len, "max_query_len")
        self.score_weights = check_score_weights({"clip": clip_weight, "frame": frame_weight})
        self.hidden_size = hidden_size

        def blocks() -> nn.ModuleList:
            return nn.ModuleList(
                GMMBlock(
                    hidden_size=hidden_size,
                    num_heads=num_heads,
                    sigmas=self.sigmas,
                    dropout=dropout,
                    attention_dropout=attention_dropout,
                    ffn_size=ffn_size,
                )
                for _ in range(num_gmm_blocks)
            )

        self.query_proj = InputProjection(in_dim=query_dim, out_dim=hidden_size, dropout=dropout)
        self.query_pos = PositionalEmbedding(max_len=max_query_len, hidden_size=hidden_size, dropout=dropout)
        self.query_encoder = TransformerLayer(
            hidden_size=hidden_size,
            num_heads=num_heads,
            dropout=dropout,
            attention_dropout=attention_dropout,
            ffn_size=ffn_size,
        )
        self.query_pool = AttentionPooling(hidden_size=hidden_size)

        self.clip_proj = InputProjection(in_dim=video_dim, out_dim=hidden_size, dropout=dropout)
        self.clip_pos = PositionalEmbedding(max_len=max_frames, hidden_size=hidden_size, dropout=dropout)
        self.clip_blocks = blocks()

        self.frame_proj = InputProjection(in_dim=video_dim, out_dim=hidden_size, dropout=dropout)
        self.frame_pos = PositionalEmbedding(max_len=max_frames, hidden_size=hidden_size, dropout=dropout)
        self.frame_blocks = blocks()
        self.frame_pool = AttentionPooling(hidden_size=hidden_size)

        init_normal_(self)

    def encode_videos(self, clips: Tensor, frames: Tensor, frame_mask: Tensor) -> VideoEmbedding:
        """(B, Lc, Dv) clips, (B, Lf, Dv) frames, (B, Lf) mask -> clip (B, Lc, D), frame (B, D)."""
        B, Lc, _ = clips.shape
        clip_packing = Packing.full(B, Lc, clips.device)
        c = self.clip_pos.forward_packed(self.clip_proj(clip_packing.pack(clips)), clip_packing)  # (B*Lc, D)
        for block in self.clip_blocks:
            c = block.forward_packed(c, clip_packing)  # (B*Lc, D)

        frame_packing = Packing.from_mask(frame_mask, B, frames.shape[1], frames.device)
        f = self.frame_pos.forward_packed(self.frame_proj(frame_packing.pack(frames)), frame_packing)  # (Nf, D)
        for block in self.frame_blocks:
            f = block.forward_packed(f, frame_packing)  # (Nf, D)
        frame = self.frame_pool.forward_packed(f, frame_packing)  # (B, D)
        extra = {}
        if self.exposes(FRAME_TOKENS):  # the frame branch is pooled: per-frame embeddings only on request
            extra = {"frame_tokens": frame_packing.unpack(f), "frame_mask": frame_packing.mask}  # (B, Lf, D), (B, Lf)
        return VideoEmbedding(clip=clip_packing.unpack(c), frame=frame, extra=extra)

    def encode_queries(self, queries: Tensor, query_mask: Tensor) -> QueryEmbedding:
        """(Nq, Lq, Dq) tokens with (Nq, Lq) mask -> one (Nq, D) vector shared by both branches."""
        packing = Packing.from_mask(query_mask, queries.shape[0], queries.shape[1], queries.device)
        t = self.query_pos.forward_packed(self.query_proj(packing.pack(queries)), packing)  # (Nt, D)
        t = self.query_encoder.forward_packed(t, packing)  # (Nt, D)
        vector = self.query_pool.forward_packed(t, packing)  # (Nq, D)
        return QueryEmbedding(
            vectors={"clip": vector, "frame": vector}, tokens=packing.unpack(t), token_mask=packing.mask
        )

    def score(
        self, query: QueryEmbedding, video: VideoEmbedding, *, with_logits: bool = False
    ) -> dict[str, BranchScores]:
        """Clip: max over clips of cosine (logits: of q.c); frame: cosine (logits: q.f)."""
        if video.clip is None or video.frame is None:
            raise ValueError("GMMFormer.score needs VideoEmbedding.clip and .frame")
        return {
            "clip": max_scores(query.vectors["clip"], video.clip, with_logits=with_logits),  # (Nq, Nv)
            "frame": vector_scores(query.vectors["frame"], video.frame, with_logits=with_logits),  # (Nq, Nv)
        }

