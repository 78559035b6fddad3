"""ARL's streamlined backbone (Cho et al., AAAI 2025, Eqs. 1-3): one transformer layer per modality,
frame-level max-similarity retrieval.

Query: InputProjection (FC + ReLU) -> positional embedding -> ``num_layers``
transformer layers -> attention pooling -> q_i (Nq, D).  Video: frames ->
InputProjection -> positional embedding P -> ``num_layers`` transformer
layers (padding skipped) -> V_j = [v_j1 .. v_jL] (B, Lf, D) (Eq. 1).  One
branch, ``frame``: s^f(q_i, v_jk) = cos(q_i, v_jk) (Eq. 2) and
s(q_i, V_j) = max over V_j's real frames of s^f (Eq. 3); logits are the
maximum raw dot product (used only by losses that read logits).

Where the paper is silent: the transformer layer is the platform's post-norm
``TransformerLayer`` with a feed-forward sublayer of width ``ffn_size``
(None: 4 x hidden, a standard layer); the paper has no clip branch, so the
batch's clip features are only encoded when a component asks for
``moment_tokens``: the same frame encoder applied to the clip sequence
(B, Lc, D), which scores nothing.  The ARL training objective lives in
the ``arl`` plug-in and the ``arl`` loss, which also work on other backbones.
"""

from __future__ import annotations

from torch import Tensor

from prvrlab.checks import check_layer_count
from prvrlab.models.base import BranchScores, QueryEmbedding, RetrievalModel, VideoEmbedding
from prvrlab.models.blocks import AttentionPooling, BackboneSizes, check_score_weights, resolve_ffn_size
from prvrlab.models.initialization import init_normal_
from prvrlab.models.component import FRAME_TOKENS, MOMENT_TOKENS, WORD_TOKENS
from prvrlab.models.gmm import TransformerLayer
from prvrlab.models.scoring import index_token_norms, indexed_norms, indexed_score_elements, max_scores
from prvrlab.registry import BACKBONES


@BACKBONES.register("arl")
class ARLModel(RetrievalModel):
    """Query and frame encoders of one transformer layer each; score = max cosine over real frames.

    ``hidden_size`` d, ``num_heads``, ``dropout`` (input, positional, residual),
    ``attention_dropout``, ``ffn_size`` (0: none, None: 4 * hidden),
    ``num_layers`` per encoder (the paper: 1), ``max_frames`` / ``max_query_len``:
    the positional tables' lengths.  Encoders: ``query`` and ``frame``.
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
        self.hidden_size, self.max_frames, self.max_query_len = hidden_size, max_frames, max_query_len
        self.score_weights = check_score_weights({"frame": 1.0})

        def layer() -> TransformerLayer:
            return TransformerLayer(**sizes.layer_args, ffn_size=ffn)

        def pool() -> AttentionPooling:
            return AttentionPooling(hidden_size=hidden_size)

        self.query = sizes.query_encoder(layer, pool=pool, num_layers=num_layers)
        self.frame = sizes.video_encoder(layer, num_layers=num_layers)
        init_normal_(self)

    def encode_videos(self, clips: Tensor, frames: Tensor, frame_mask: Tensor) -> VideoEmbedding:
        """(B, Lf, Dv) frames with a (B, Lf) mask -> per-frame V_j (B, Lf, D) + mask (Eq. 1); the
        (B, Lc, Dv) clips through the frame encoder only when ``moment_tokens`` is requested."""
        f, packing = self.frame.encode(frames, frame_mask)  # (Nf, D)
        clip = self.frame(clips) if self.exposes(MOMENT_TOKENS) else None  # (B, Lc, D)
        return VideoEmbedding(clip=clip, frame=packing.unpack(f), frame_mask=packing.mask)  # (B, Lf, D), (B, Lf)

    def encode_queries(self, queries: Tensor, query_mask: Tensor) -> QueryEmbedding:
        """(Nq, Lq, Dq) tokens with (Nq, Lq) mask -> q_i (Nq, D) and, on request, the word tokens."""
        return self.query.embed(
            queries, query_mask, branches=("frame",), keep_tokens=self.keeps_word_tokens()
        )

    score_elements = staticmethod(indexed_score_elements)
    low_precision_fields = ("frame",)  # max-scored, indexed by index_token_norms

    def index_videos(self, video: VideoEmbedding) -> VideoEmbedding:
        """Adds the frames' norms (:func:`~prvrlab.models.scoring.index_token_norms`)."""
        return index_token_norms(video, ("frame",))

    def score(
        self, query: QueryEmbedding, video: VideoEmbedding, *, with_logits: bool = False
    ) -> dict[str, BranchScores]:
        """``frame``: max over real frames of cos(q_i, v_jk) (Eqs. 2-3); logits: max raw dot."""
        if video.frame is None or video.frame.dim() != 3:
            raise ValueError("ARLModel.score needs per-frame VideoEmbedding.frame (B, Lf, D)")
        frame = max_scores(
            query.vectors["frame"], video.frame, video.frame_mask, with_logits=with_logits,
            video_norm=indexed_norms(video, "frame"),
        )  # (Nq, Nv)
        return {"frame": frame}
