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
tensor of the model; ``ffn_size > 0`` adds feed-forward sublayers the
reference does not have.  The Gaussian windows follow the reference's
formula (``window: official``) over the clip count for clips and, by default,
``max_frames`` for frames (``window_length: padded``: a video's scores never
depend on the other videos of its batch).  The reference's frame windows span
the batch's longest video (its collate functions pad each batch to that
length): ``window_length: batch``, which the official dataset configs set
(training then pads every DDP rank's frames to the global batch's longest
video, and evaluation encodes a split in order, ``eval.video_batch_size``
videos a batch, as the reference's evaluation does).  ``window: centred`` with
``window_length: real`` centres each row on its diagonal and spans each
video's real length (:mod:`prvrlab.models.gmm`).
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import Tensor

from prvrlab.checks import check_bool, check_layer_count
from prvrlab.models.blocks import (
    AttentionPooling,
    BackboneSizes,
    PooledFrameBackbone,
    check_score_weights,
    legacy_encoder_keys,
    resolve_ffn_size,
)
from prvrlab.models.initialization import init_normal_
from prvrlab.models.component import FRAME_TOKENS, MOMENT_TOKENS, WORD_TOKENS
from prvrlab.models.gmm import (
    GMMBlock, TransformerLayer, VideoWindowLength, Window, WindowLength, parse_sigmas, video_window_spans,
)
from prvrlab.registry import BACKBONES


@BACKBONES.register("gmmformer")
class GMMFormer(PooledFrameBackbone):
    """GMMFormer with a clip branch (max over the clips) and a pooled frame branch.

    ``sigmas``: widths of the Gaussian branches of every GMMBlock (``"inf"`` or
    float inf: plain attention); ``num_gmm_blocks`` blocks per video branch;
    ``dropout``: input, positional and residual dropout; ``attention_dropout``:
    on attention probabilities; ``ffn_size``: width of the feed-forward
    sublayer after every attention layer, the query encoder's included (0:
    none, as the reference; None: 4 * hidden_size); ``clip_weight`` /
    ``frame_weight``: the branches' weights in the retrieval score;
    ``window`` / ``window_length``: the Gaussian windows (``official`` /
    ``batch``: the reference's; ``padded``: frames span ``max_frames``;
    ``centred`` / ``real``: centred on the diagonal over each video's real
    length; module docstring); ``query_redraw``: in training the queries are
    encoded a second time (another dropout draw) as the training-only query
    vector ``redrawn``, which the reference's ``forward`` encodes for its
    query-diverse loss (``branch: redrawn``; False: no second encoding).  Encoders: ``query``,
    ``clip`` and ``frame`` (:class:`SequenceEncoder`).
    """

    corrected: ClassVar[dict[str, Any]] = {"window": "centred", "window_length": "real"}  # the `corrected` preset (docs/parity.md)

    provides = frozenset({FRAME_TOKENS, WORD_TOKENS, MOMENT_TOKENS})
    low_precision_fields = ("clip",)  # max-scored: bf16 products in a bf16 evaluation
    legacy_keys = {
        **legacy_encoder_keys("query", layers="query_encoder", single_layer=True, pool="query_pool"),
        **legacy_encoder_keys("clip", layers="clip_blocks"),
        **legacy_encoder_keys("frame", layers="frame_blocks", pool="frame_pool"),
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
        sigmas: list[float | str] = [0.5, 1.0, 5.0, "inf"],  # noqa: B006 - never mutated
        num_gmm_blocks: int = 2,
        max_frames: int = 128,
        max_query_len: int = 30,
        clip_weight: float = 0.7,
        frame_weight: float = 0.3,
        window: Window = "official",
        window_length: VideoWindowLength = "padded",
        query_redraw: bool = False,
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
        self.sigmas = parse_sigmas(sigmas)
        ffn = resolve_ffn_size(ffn_size, hidden_size)
        check_layer_count(num_gmm_blocks, "num_gmm_blocks")
        self.score_weights = check_score_weights({"clip": clip_weight, "frame": frame_weight})
        self.hidden_size, self.max_frames, self.max_query_len = hidden_size, max_frames, max_query_len

        clip_span, frame_span = video_window_spans(window, window_length, max_frames)
        self.window, self.window_length = window, window_length
        self.query_redraw = check_bool(query_redraw, "query_redraw")

        def block(span: WindowLength) -> GMMBlock:
            return GMMBlock(**sizes.layer_args, sigmas=self.sigmas, ffn_size=ffn, window=window, window_length=span)

        def pool() -> AttentionPooling:
            return AttentionPooling(hidden_size=hidden_size)

        self.query = sizes.query_encoder(lambda: TransformerLayer(**sizes.layer_args, ffn_size=ffn), pool=pool)
        self.clip = sizes.video_encoder(lambda: block(clip_span), num_layers=num_gmm_blocks)  # clips: never padded
        self.frame = sizes.video_encoder(lambda: block(frame_span), num_layers=num_gmm_blocks, pool=pool)
        init_normal_(self)

    def encode_clips(self, clips: Tensor) -> Tensor:
        """(B, Lc, Dv) -> (B, Lc, D)."""
        return self.clip(clips)
