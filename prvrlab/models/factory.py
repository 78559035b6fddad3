"""One place that builds a backbone, its plug-ins and the loss terms from config sections.

Training, evaluation, checkpoint loading, profiling and config validation all
build through here, by registered name only::

    model  = build_model(model_cfg, plugins_cfg, video_dim=..., query_dim=...)   # retrieval
    system = build_system(model_cfg, plugins_cfg, losses_cfg, video_dim=..., query_dim=...)  # training

The sections are plain mappings (``{"name": "gmmformer", **params}``,
``{plugin: params}``, ``{term: {"loss": name, "weight": w, **params}}``), so
nothing here depends on the platform's config types.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from prvrlab.data.batch import Batch
from prvrlab.losses.weighted import LossResult, WeightedLoss
from prvrlab.models.base import ModelOutput, RetrievalModel
from prvrlab.models.component import CAPABILITIES, DATA_CAPABILITIES, Component
from prvrlab.models.global_batch import gather_batch
from prvrlab.models.plugins.base import PluggedModel, Plugin, PluginError
from prvrlab.registry import BACKBONES, PLUGINS


class _SkipRandomInit(TorchFunctionMode):
    """Random in-place initialisers become no-ops: on the meta device they compute nothing anyway,
    and torch's meta ``normal_`` imports ``torch._dynamo`` (~1.6 s) on its first call."""

    SKIPPED = frozenset(
        [
            getattr(torch.Tensor, name)
            for name in ("normal_", "uniform_", "log_normal_", "exponential_", "geometric_", "cauchy_", "random_", "bernoulli_")
        ]
        + [
            getattr(nn.init, name)  # seen before the Tensor methods they call, which then bypass the modes
            for name in ("normal_", "uniform_", "trunc_normal_", "kaiming_normal_", "kaiming_uniform_", "xavier_normal_", "xavier_uniform_", "orthogonal_", "sparse_")
        ]
    )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.SKIPPED:
            tensor = args[0] if args else kwargs.get("tensor")  # nn.init passes it by keyword
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """Build modules on the meta device (shapes only, no memory, no random initialisation): for checks
    that only need a model's structure (config validation, the metrics it declares)."""
    with torch.device("meta"), _SkipRandomInit():
        yield


class NeedsError(ValueError):
    """A component needs a capability the backbone does not provide."""


def build_backbone(model_cfg: Mapping[str, Any], *, video_dim: int, query_dim: int) -> RetrievalModel:
    """The registered backbone ``model_cfg['name']`` with the section's parameters."""
    params = {k: v for k, v in model_cfg.items() if k != "name"}
    return BACKBONES.build(model_cfg["name"], video_dim=video_dim, query_dim=query_dim, **params)


def build_plugins(plugins_cfg: Mapping[str, Mapping[str, Any]], *, hidden_size: int) -> dict[str, Plugin]:
    """Every configured plug-in, in config order, built for a backbone of width ``hidden_size``;
    a constructor's ValueError is re-raised naming ``plugins.<name>``."""
    out: dict[str, Plugin] = {}
    for name, params in plugins_cfg.items():
        try:
            out[name] = PLUGINS.build(name, hidden_size=hidden_size, **dict(params or {}))
        except ValueError as exc:
            raise type(exc)(f"plugins.{name}: {exc}") from None
    return out


def check_needs(backbone: RetrievalModel, backbone_name: str, components: Mapping[str, Component]) -> None:
    """Raise NeedsError when a component (``where`` -> component) needs what the backbone lacks."""
    available = frozenset(backbone.provides) | DATA_CAPABILITIES
    for where, component in components.items():
        needed = component.needs(training=True) | component.needs(training=False)
        missing = sorted(needed - available)
        if missing:
            kind = type(component).__dict__.get("registered_name", type(component).__name__)
            raise NeedsError(
                f"{where}: '{kind}' needs {', '.join(missing)} ({CAPABILITIES[missing[0]]}), which backbone "
                f"'{backbone_name}' does not provide; it provides: {', '.join(sorted(available))}"
            )


def build_model(
    model_cfg: Mapping[str, Any],
    plugins_cfg: Mapping[str, Mapping[str, Any]] | None = None,
    *,
    video_dim: int,
    query_dim: int,
) -> RetrievalModel:
    """The backbone, wrapped with its plug-ins (:class:`PluggedModel`) when there are any.

    The backbone is asked to expose what the plug-ins need at retrieval time
    (``build_system`` adds the training needs of plug-ins and losses).
    """
    backbone = build_backbone(model_cfg, video_dim=video_dim, query_dim=query_dim)
    plugins = build_plugins(plugins_cfg or {}, hidden_size=int(getattr(backbone, "hidden_size")))
    for name, plugin in plugins.items():
        try:
            plugin.check_backbone(backbone, str(model_cfg["name"]))
        except ValueError as exc:
            raise type(exc)(f"plugins.{name}: {exc}") from None
    check_needs(backbone, str(model_cfg["name"]), {f"plugins.{n}": p for n, p in plugins.items()})
    model: RetrievalModel = backbone
    if plugins:
        model = PluggedModel(
            backbone=backbone,
            plugins=plugins,
            make_backbone=lambda: build_backbone(model_cfg, video_dim=video_dim, query_dim=query_dim),
        )
    model.request(
        training=set().union(*(p.needs(training=True) for p in plugins.values())),
        retrieval=set().union(*(p.needs(training=False) for p in plugins.values())),
    )
    return model


def build_losses(losses_cfg: Mapping[str, Mapping[str, Any]]) -> WeightedLoss:
    """The weighted sum of the configured loss terms."""
    return WeightedLoss.from_config(losses_cfg)


class TrainingSystem(nn.Module):
    """Everything that learns: the model (backbone + plug-ins) and the loss terms.

    The training loop optimises, wraps in DDP and checkpoints this module, so
    every parameter of every component (a loss's learnable temperature, a
    plug-in's second encoder) trains, is averaged across ranks and survives a
    restart.  ``forward`` runs the model under the caller's autocast and the
    losses in full precision.
    """

    def __init__(self, *, model: RetrievalModel, losses: WeightedLoss, global_batch: bool = False) -> None:
        super().__init__()
        self.model = model
        self.losses = losses
        self.global_batch = global_batch
        plugins = self.plugins()
        if global_batch:
            for name, plugin in plugins.items():
                if not plugin.supports_global_batch:
                    raise PluginError(
                        f"plugins.{name}: '{type(plugin).registered_name}' computes on each DDP rank's share of "
                        "a batch (its class does not declare supports_global_batch = True); set train.ddp_batch: "
                        "local (or train.num_workers: 1)"
                    )
        model.request(
            training=set().union(*(c.needs(training=True) for c in self.components().values())),
            retrieval=set().union(*(p.needs(training=False) for p in plugins.values())),
        )
        for term, loss in losses.losses.items():
            if losses.weights[term] == 0.0:  # never computed: its parameters get no gradient (DDP would refuse)
                loss.requires_grad_(False)

    def plugins(self) -> dict[str, Plugin]:
        """Plug-in name -> plug-in (empty for a bare backbone)."""
        return dict(self.model.plugins.items()) if isinstance(self.model, PluggedModel) else {}

    def components(self) -> dict[str, Component]:
        """Metric prefix -> component: plug-ins by name, then loss terms by term name."""
        out: dict[str, Component] = dict(self.plugins())
        out.update({term: loss for term, loss in self.losses.losses.items() if self.losses.weights[term] > 0})
        return out

    def forward(self, batch: Batch, *, epoch: int) -> tuple[LossResult, ModelOutput]:
        """(weighted loss, model output) of a training batch; with ``global_batch`` (a DDP rank's share,
        ``train.ddp_batch: global``) the shares' encodings are gathered first, so the scores and the loss
        span the global batch (:mod:`prvrlab.models.global_batch`; ``model output.batch`` is that batch)."""
        encoding = self.model.encode_batch(batch)
        if self.global_batch:
            encoding, batch = gather_batch(encoding, batch)
        out = self.model.score_batch(batch, encoding)
        with torch.autocast(batch.queries.device.type, enabled=False):
            result = self.losses(out, batch, epoch=epoch)
        return result, out


def build_system(
    model_cfg: Mapping[str, Any],
    plugins_cfg: Mapping[str, Mapping[str, Any]] | None,
    losses_cfg: Mapping[str, Mapping[str, Any]],
    *,
    video_dim: int,
    query_dim: int,
    global_batch: bool = False,
) -> TrainingSystem:
    """Model and losses for training; losses whose needs the backbone lacks are refused here too.
    ``global_batch``: the losses span the global batch gathered from the DDP ranks (:class:`TrainingSystem`)."""
    clash = sorted(set(losses_cfg) & set(plugins_cfg or {}))
    if clash:  # components() keys both by name: the plug-in's hooks and metrics would be lost
        raise ValueError(
            f"losses.{clash[0]}: a loss term may not share its name with the plug-in '{clash[0]}' "
            "(metrics and hooks are keyed by it); rename the term"
        )
    model = build_model(model_cfg, plugins_cfg, video_dim=video_dim, query_dim=query_dim)
    losses = build_losses(losses_cfg)
    backbone = model.backbone if isinstance(model, PluggedModel) else model
    active = {f"losses.{t}": loss for t, loss in losses.losses.items() if losses.weights[t] > 0}  # weight 0: never run
    check_needs(backbone, str(model_cfg["name"]), active)
    return TrainingSystem(model=model, losses=losses, global_batch=global_batch)


def declared_metrics(system: TrainingSystem) -> list[str]:
    """``train/<component>.<name>`` for every metric the components declare."""
    return [f"train/{prefix}.{name}" for prefix, c in system.components().items() for name in c.metric_names()]
