"""The plug-in contract and the model that wraps a backbone with plug-ins.

A :class:`Plugin` is a :class:`~prvrlab.models.component.Component` (needs,
epoch/step hooks, metrics) with keyword-only constructor parameters (its
config section) plus ``hidden_size``, which the platform derives from the
backbone.  Besides the component hooks it can

- ``check_backbone``: refuse a backbone it does not fit (config validation
  calls it on a meta-device backbone, so the message reaches the user before
  anything runs);
- ``attach``: receive the backbone it is plugged into and a factory for
  fresh copies of it (e.g. a second encoder trained beside the first);
  modules the plug-in creates are its own parameters, so the optimiser,
  DDP and checkpoints include them.  The backbone itself is *not* a
  sub-module of the plug-in (read it through ``self.host``);
- ``encode_videos`` / ``encode_queries``: add per-video / per-query values
  (tensors with the item index first, or whole embeddings of an auxiliary
  encoder) to ``VideoEmbedding.extra`` / ``QueryEmbedding.extra`` under
  ``"<plugin>.<key>"``; these run at training and retrieval time, so
  retrieval may use them;
- ``adjust_scores``: replace or change branch scores (training and
  retrieval, :meth:`PluggedModel.score`);
- ``index_videos``: replace its own ``extra`` entries in the indexed
  gallery of retrieval (e.g. a second encoder's embedding, indexed by that
  encoder);
- ``aux_keys`` / ``training_aux``: training-only extras written into
  ``ModelOutput.aux`` under ``"<plugin>.<key>"`` (never called by
  evaluation; config validation checks that losses reading them have them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any, ClassVar

from torch import Tensor, nn

from prvrlab.data.batch import Batch
from prvrlab.models.base import BatchEncoding, BranchScores, ModelOutput, QueryEmbedding, RetrievalModel, VideoEmbedding
from prvrlab.models.component import Component


class PluginError(ValueError):
    """A plug-in does not fit the backbone or the data it was given."""


class Plugin(Component):
    """Base class of every plug-in (all hooks default to 'do nothing')."""

    registered_name: str = "plugin"
    # Boolean constructor parameters that switch parts on/off (run tags and
    # ablation components list them as ``plugin:<name>.<part>``).
    switch_params: tuple[str, ...] = ()
    # Whether training_aux and the step hook work on the global batch gathered from the DDP ranks
    # (train.ddp_batch: global): they read only the encodings and the batch's masks, query_video and
    # ids, never its features, and count nothing per rank that the ranks' sums would count again.
    supports_global_batch: ClassVar[bool] = False

    def check_backbone(self, backbone: RetrievalModel, backbone_name: str) -> None:
        """Raise PluginError when ``backbone`` lacks what this plug-in needs."""

    def attach(self, backbone: RetrievalModel, *, make_backbone: Callable[[], RetrievalModel] | None) -> None:
        """Called once by :class:`PluggedModel`; keeps ``backbone`` as ``self.host`` (not a sub-module)."""
        self.__dict__["host"] = backbone

    def aux_keys(self) -> tuple[str, ...]:
        """Keys (without the prefix) ``training_aux`` provides; losses requiring others fail validation."""
        return ()

    def trained_parts(self) -> dict[str, tuple[str, ...]]:
        """Parts that are on (``switch_params`` names) whose parameters train only through the loss terms reading
        their training outputs -> those ``aux_keys``; validation refuses a part no loss term of the config reads,
        at any weight (its parameters would train on nothing).  None by default."""
        return {}

    def encode_videos(self, clips: Tensor, frames: Tensor, frame_mask: Tensor, video: VideoEmbedding) -> dict[str, Any]:
        """Extra per-video values (keys without the prefix) added to ``video.extra``."""
        return {}

    def encode_queries(self, queries: Tensor, query_mask: Tensor, query: QueryEmbedding) -> dict[str, Any]:
        """Extra per-query values (keys without the prefix) added to ``query.extra``."""
        return {}

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

    def index_videos(self, video: VideoEmbedding) -> dict[str, Any]:
        """Replacements (keys without the prefix) for this plug-in's entries of ``video.extra`` in the
        indexed gallery (:meth:`RetrievalModel.index_videos`), e.g. a second encoder's embedding indexed
        by that encoder; none by default."""
        return {}

    def encode_training(self, batch: Batch, video: VideoEmbedding) -> dict[str, Any]:
        """Training-only per-video values computed from the batch's features (keys without the prefix), added
        to ``video.extra`` before any row is compared with another: one row per video (tensors, or nested
        embeddings), so under ``train.ddp_batch: global`` each rank computes its share's and they are
        gathered with the encodings (ICE's shuffled videos).  None by default."""
        return {}

    def training_aux(self, batch: Batch, query: QueryEmbedding, video: VideoEmbedding) -> dict[str, Any]:
        """Training-only extras (keys without the plug-in prefix)."""
        return {}


class PluggedModel(RetrievalModel):
    """A backbone plus plug-ins, itself a :class:`RetrievalModel`.

    Encoding is the backbone's followed by every plug-in's ``encode_*``;
    ``score`` is the backbone's followed by every plug-in's ``adjust_scores``
    in config order; ``forward`` additionally collects every plug-in's
    ``training_aux``.
    """

    def __init__(
        self,
        *,
        backbone: RetrievalModel,
        plugins: dict[str, Plugin],
        make_backbone: Callable[[], RetrievalModel] | None = None,
    ) -> None:
        super().__init__()
        if not plugins:
            raise ValueError("PluggedModel needs at least one plug-in; use the bare backbone otherwise")
        self.backbone = backbone
        self.plugins = nn.ModuleDict(plugins)
        self.provides = backbone.provides  # type: ignore[misc]
        for plugin in plugins.values():
            plugin.attach(backbone, make_backbone=make_backbone)

    def request(self, *, training: Iterable[str] = (), retrieval: Iterable[str] = ()) -> None:
        """Forwarded to the backbone (which does the encoding)."""
        self.backbone.request(training=training, retrieval=retrieval)

    def training_exposure(self):
        """The backbone's (it does the encoding)."""
        return self.backbone.training_exposure()

    @property
    def score_weights(self) -> dict[str, float]:  # type: ignore[override]
        return self.backbone.score_weights

    def encode_videos(self, clips: Tensor, frames: Tensor, frame_mask: Tensor) -> VideoEmbedding:
        video = self.backbone.encode_videos(clips, frames, frame_mask)
        for name, plugin in self.plugins.items():
            for key, value in plugin.encode_videos(clips, frames, frame_mask, video).items():
                video.extra[f"{name}.{key}"] = value
        return video

    def encode_queries(self, queries: Tensor, query_mask: Tensor) -> QueryEmbedding:
        query = self.backbone.encode_queries(queries, query_mask)
        for name, plugin in self.plugins.items():
            for key, value in plugin.encode_queries(queries, query_mask, query).items():
                query.extra[f"{name}.{key}"] = value
        return query

    def encode_budget_share(self) -> float:
        """The backbone's (its encoders hold most of an evaluation batch's working set)."""
        return self.backbone.encode_budget_share()

    def batch_dependent_videos(self) -> bool:
        """The backbone's (it encodes the videos)."""
        return self.backbone.batch_dependent_videos()

    def index_videos(self, video: VideoEmbedding) -> VideoEmbedding:
        """The backbone's index (plug-in entries of ``extra`` kept), then every plug-in's replacements."""
        video = self.backbone.index_videos(video)
        updates = {
            f"{name}.{key}": value
            for name, plugin in self.plugins.items()
            for key, value in plugin.index_videos(video).items()
            if video.extra.get(f"{name}.{key}") is not value
        }
        return replace(video, extra={**video.extra, **updates}) if updates else video

    def score(
        self, query: QueryEmbedding, video: VideoEmbedding, *, with_logits: bool = False
    ) -> dict[str, BranchScores]:
        scores = self.backbone.score(query, video, with_logits=with_logits)
        for plugin in self.plugins.values():
            scores = plugin.adjust_scores(query, video, scores, with_logits=with_logits)
        return scores

    def fuse(self, scores: dict[str, BranchScores]) -> Tensor:
        return self.backbone.fuse(scores)

    def batch_vectors(
        self, batch: Batch, query: QueryEmbedding, video: VideoEmbedding, redrawn: QueryEmbedding | None = None
    ) -> dict[str, Tensor]:
        return self.backbone.batch_vectors(batch, query, video, redrawn)

    def redrawn_queries(self, batch: Batch) -> QueryEmbedding:
        """The backbone's (the plug-ins' query encodings are not drawn again)."""
        return self.backbone.redrawn_queries(batch)

    @property
    def query_redraw(self) -> bool:  # type: ignore[override]
        return self.backbone.query_redraw

    def batch_vector_names(self) -> tuple[str, ...]:
        return self.backbone.batch_vector_names()

    def encode_batch(self, batch: Batch) -> BatchEncoding:
        """:meth:`RetrievalModel.encode_batch` through the plug-ins' encoding, then every plug-in's
        :meth:`Plugin.encode_training` values in ``video.extra``."""
        encoding = super().encode_batch(batch)
        for name, plugin in self.plugins.items():
            for key, value in plugin.encode_training(batch, encoding.video).items():
                encoding.video.extra[f"{name}.{key}"] = value
        return encoding

    def score_batch(self, batch: Batch, encoding: BatchEncoding) -> ModelOutput:
        """:meth:`RetrievalModel.score_batch` through the plug-ins' scoring, plus every plug-in's aux."""
        out = super().score_batch(batch, encoding)
        for name, plugin in self.plugins.items():
            for key, value in plugin.training_aux(batch, out.query, out.video).items():
                out.aux[f"{name}.{key}"] = value
        return out
