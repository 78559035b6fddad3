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

from torch import Tensor

from prvrlab.checks import check_layer_count
from prvrlab.models.blocks import (
    AdditiveAttentionPooling,
    BackboneSizes,
    PooledFrameBackbone,
    check_score_weights,
    legacy_encoder_keys,
    resolve_ffn_size,
)
from prvrlab.models.initialization import init_normal_
from prvrlab.models.component import FRAME_TOKENS, MOMENT_TOKENS, WORD_TOKENS
from prvrlab.models.gmm import TransformerLayer
from prvrlab.registry import BACKBONES


@BACKBONES.register("ice_base")
class ICEBase(PooledFrameBackbone):
    """Video-level (pooled frames) and moment-level (max over 32 moments) branches.

    ``num_layers``: transformer layers of every encoder; ``ffn_size``: width
    of their feed-forward sublayers (None: 4 * hidden_size, a standard
    transformer layer; 0: none); ``moment_weight`` (alpha) / ``video_weight``
    (1 - alpha): the branches' weights in the retrieval score (each >= 0; the
    paper's alpha = 0.7; they need not sum to 1, ranking only depends on their
    ratio).  Encoders: ``query``, ``moment`` and ``frame`` (the video-level
    branch, :class:`SequenceEncoder`).
    """

    provides = frozenset({FRAME_TOKENS, WORD_TOKENS, MOMENT_TOKENS})
    low_precision_fields = ("clip",)  # max-scored: bf16 products in a bf16 evaluation
    branches = ("moment", "video")
    legacy_keys = {
        **legacy_encoder_keys("query", layers="query_encoder", pool="query_pool"),
        **legacy_encoder_keys("moment", layers="moment_encoder"),
        **legacy_encoder_keys("frame", layers="frame_encoder", pool="video_pool"),
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
        ffn_size: int | None = None,
        num_layers: int = 1,
        max_frames: int = 128,
        max_query_len: int = 30,
        moment_weight: float = 0.7,
        video_weight: float = 0.3,
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
        check_layer_count(num_layers, "num_layers")
        self.score_weights = check_score_weights({"moment": moment_weight, "video": video_weight})
        self.hidden_size, self.max_frames, self.max_query_len = hidden_size, max_frames, max_query_len

        def layer() -> TransformerLayer:
            return TransformerLayer(**sizes.layer_args, ffn_size=ffn)

        def pool() -> AdditiveAttentionPooling:
            return AdditiveAttentionPooling(hidden_size=hidden_size)

        self.query = sizes.query_encoder(layer, num_layers=num_layers, pool=pool)
        self.moment = sizes.video_encoder(layer, num_layers=num_layers)
        self.frame = sizes.video_encoder(layer, num_layers=num_layers, pool=pool)
        init_normal_(self)

    def encode_clips(self, clips: Tensor) -> Tensor:
        """(B, T_m, Dv) moments (the clips) -> (B, T_m, D)."""
        return self.moment(clips)
