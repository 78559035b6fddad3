"""The plug-in contract and the model that wraps a backbone with plug-ins.

A :class:`Plugin` is an ``nn.Module`` with keyword-only constructor
parameters (its config section) plus ``hidden_size``, which the platform
derives from the backbone.  It can

- ``check_backbone``: refuse a backbone it does not fit (config validation
  calls it on a meta-device backbone, so the message reaches the user before
  anything runs);
- ``needs_frame_tokens``: ask the backbone for per-frame embeddings through
  the generic hook ``RetrievalModel.expose_frame_tokens`` (per mode, so that
  retrieval keeps no per-frame tensors a plug-in only needs for training);
- ``aux_keys``: what ``training_aux`` provides (config validation checks
  that losses reading plug-in outputs have them);
- ``adjust_scores``: replace or change branch scores; this runs at training
  *and* retrieval time (``PluggedModel.score``);
- ``training_aux``: training-only extras written into ``ModelOutput.aux``
  under ``"<plugin>.<key>"``; never called by evaluation.  Keys starting with
  ``metric.`` (i.e. ``"metric.<plugin>.<name>"`` after namespacing) hold
  scalars the training worker averages per epoch and logs as
  ``train/<plugin>.<name>``.

Its parameters are registered as submodules of :class:`PluggedModel`, so the
optimiser, DDP and checkpoints include them.
"""

from __future__ import annotations

from torch import Tensor, nn

from prvrlab.data.batch import Batch
from prvrlab.models.base import BranchScores, ModelOutput, QueryEmbedding, RetrievalModel, VideoEmbedding

METRIC_PREFIX = "metric."


class PluginError(ValueError):
    """A plug-in does not fit the backbone or the data it was given."""


class Plugin(nn.Module):
    """Base class of every plug-in (all hooks default to 'do nothing')."""

    registered_name: str = "plugin"
    # Boolean constructor parameters that switch parts on/off (run tags and
    # ablation components list them as ``plugin:<name>.<part>``).
    switch_params: tuple[str, ...] = ()

    def check_backbone(self, backbone: RetrievalModel, backbone_name: str) -> None:
        """Raise PluginError when ``backbone`` lacks what this plug-in needs."""

    def needs_frame_tokens(self, training: bool) -> bool:
        """Whether the backbone must expose per-frame embeddings (in train / eval mode)."""
        return False

    def aux_keys(self) -> tuple[str, ...]:
        """Keys (without the prefix) ``training_aux`` provides; losses requiring others fail validation."""
        return ()

    def adjust_scores(
        self,
        query: QueryEmbedding,
        video: VideoEmbedding,
        scores: dict[str, BranchScores],
        *,
        with_logits: bool,
    ) -> dict[str, BranchScores]:
        """Branch scores after this plug-in (training and retrieval)."""
        return scores

    def training_aux(self, batch: Batch, query: QueryEmbedding, video: VideoEmbedding) -> dict[str, Tensor]:
        """Training-only extras (keys without the plug-in prefix)."""
        return {}


def frame_tokens(video: VideoEmbedding, who: str) -> tuple[Tensor, Tensor]:
    """Per-frame embeddings (Nv, Lf, D) and their (Nv, Lf) bool mask.

    Read from ``extra['frame_tokens']`` / ``extra['frame_mask']`` (backbones
    whose ``frame`` is pooled put them there when ``expose_frame_tokens`` is
    set), else from a per-frame ``frame`` (Nv, Lf, D) with ``frame_mask``.
    """
    if "frame_tokens" in video.extra:
        tokens = video.extra["frame_tokens"]
        mask = video.extra.get("frame_mask")
    elif video.frame is not None and video.frame.dim() == 3:
        tokens, mask = video.frame, video.frame_mask
    else:
        raise PluginError(
            f"{who} needs per-frame embeddings: VideoEmbedding.extra['frame_tokens'] or a (Nv, Lf, D) "
            "VideoEmbedding.frame; this backbone provides neither"
        )
    if mask is None:
        mask = tokens.new_ones(tokens.shape[:2], dtype=bool)
    return tokens, mask.to(bool)


class PluggedModel(RetrievalModel):
    """A backbone plus plug-ins, itself a :class:`RetrievalModel`.

    Encoding is the backbone's; ``score`` is the backbone's followed by every
    plug-in's ``adjust_scores`` in config order; ``forward`` additionally
    collects every plug-in's ``training_aux``.
    """

    def __init__(self, *, backbone: RetrievalModel, plugins: dict[str, Plugin]) -> None:
        super().__init__()
        if not plugins:
            raise ValueError("PluggedModel needs at least one plug-in; use the bare backbone otherwise")
        self.backbone = backbone
        self.plugins = nn.ModuleDict(plugins)
        self._sync_hooks()

    def _sync_hooks(self, training: bool | None = None) -> None:
        training = self.training if training is None else training
        self.backbone.expose_frame_tokens = any(p.needs_frame_tokens(training) for p in self.plugins.values())

    def train(self, mode: bool = True) -> "PluggedModel":
        super().train(mode)
        self._sync_hooks()
        return self

    @property
    def score_weights(self) -> dict[str, float]:  # type: ignore[override]
        return self.backbone.score_weights

    def encode_videos(self, clips: Tensor, frames: Tensor, frame_mask: Tensor) -> VideoEmbedding:
        return self.backbone.encode_videos(clips, frames, frame_mask)

    def encode_queries(self, queries: Tensor, query_mask: Tensor) -> QueryEmbedding:
        return self.backbone.encode_queries(queries, query_mask)

    def score(
        self, query: QueryEmbedding, video: VideoEmbedding, *, with_logits: bool = False
    ) -> dict[str, BranchScores]:
        scores = self.backbone.score(query, video, with_logits=with_logits)
        for plugin in self.plugins.values():
            scores = plugin.adjust_scores(query, video, scores, with_logits=with_logits)
        return scores

    def fuse(self, scores: dict[str, BranchScores]) -> Tensor:
        return self.backbone.fuse(scores)

    def forward(self, batch: Batch) -> ModelOutput:
        """The training path (whatever the module mode): scores plus every plug-in's aux."""
        self._sync_hooks(training=True)
        try:
            video = self.encode_videos(batch.clips, batch.frames, batch.frame_mask)
        finally:
            self._sync_hooks()
        query = self.encode_queries(batch.queries, batch.query_mask)
        scores = self.score(query, video, with_logits=True)
        aux: dict[str, Tensor] = {}
        for name, plugin in self.plugins.items():
            for key, value in plugin.training_aux(batch, query, video).items():
                if key.startswith(METRIC_PREFIX):
                    aux[f"{METRIC_PREFIX}{name}.{key[len(METRIC_PREFIX):]}"] = value
                else:
                    aux[f"{name}.{key}"] = value
        return ModelOutput(scores=scores, query=query, video=video, aux=aux)
