"""The extension seam: what losses and plug-ins declare, and the hooks the training loop calls.

Every loss and every plug-in is a :class:`Component`.  A component

- declares what it **needs** from the backbone (:data:`CAPABILITIES`):
  per-frame embeddings, per-word embeddings, moment/clip-level embeddings,
  per-video query groups.  Config validation rejects a component whose
  needs the configured backbone cannot meet, naming both; the backbone is
  asked to expose exactly what the enabled components need (training and
  retrieval separately, so retrieval keeps no tensor only training reads);
- owns learnable parameters, auxiliary encoders (e.g. a second backbone
  copy) and buffers like any ``nn.Module``: the training loop puts every
  parameter of every component in the optimiser, the DDP wrapper and the
  checkpoint;
- may act at **epoch start / epoch end** (:meth:`Component.on_epoch_start`,
  :meth:`Component.on_epoch_end`) with an :class:`EpochContext`: the model,
  a loader over this rank's share of the training split, the device and
  an all-reduce over the DDP process group (e.g. a dataset-wide statistic
  recomputed with the current model), and **after every optimiser step**
  (:meth:`Component.on_step_end`);
- reports scalar **metrics** (:meth:`Component.log_metric` during a step,
  or returned by the epoch hooks).  They are logged per epoch as
  ``train/<component>.<name>`` (``<component>`` = the plug-in name or the
  loss term), usable as a search or ablation metric when listed in
  :meth:`Component.metric_names`, and shown by the reports;
- reports **distributions** (:meth:`Component.log_distribution` from an
  epoch hook: named series of one quantity, e.g. the similarity of positive
  and of unpaired pairs).  The loop bins them (:func:`histogram_record`),
  sums the bins over the ranks and writes the run artifact
  ``distributions/<component>.<name>.json`` (the last epoch that logged the
  name wins); the reports draw every such artifact they find.

Nothing here imports the data layer's loaders or the platform: the training
loop builds the contexts and hands them in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

# ---------------------------------------------------------------- capabilities

FRAME_TOKENS = "frame_tokens"
WORD_TOKENS = "word_tokens"
MOMENT_TOKENS = "moment_tokens"
QUERY_GROUPS = "query_groups"

CAPABILITIES: dict[str, str] = {
    FRAME_TOKENS: "per-frame video embeddings (Nv, Lf, D) with their mask: VideoEmbedding.frame_tokens()",
    WORD_TOKENS: "per-word query embeddings (Nq, Lq, D) with their mask: QueryEmbedding.word_tokens()",
    MOMENT_TOKENS: "moment/clip-level video embeddings (Nv, M, D) with their mask: VideoEmbedding.moment_tokens()",
    QUERY_GROUPS: "per-video query groups (Batch.query_video: each video's queries are contiguous)",
}
# Provided by the data layer's batching for every backbone.
DATA_CAPABILITIES = frozenset({QUERY_GROUPS})


def check_capabilities(names: Iterable[str], who: str) -> frozenset[str]:
    """``names`` as a frozenset, or a ValueError naming the unknown one and the valid ones."""
    out = frozenset(names)
    unknown = sorted(out - set(CAPABILITIES))
    if unknown:
        raise ValueError(f"{who}: unknown capability {unknown[0]!r}; known: {', '.join(CAPABILITIES)}")
    return out


# ---------------------------------------------------------------- contexts


def _identity_reduce(tensor: Tensor, op: str = "sum") -> Tensor:
    return tensor


@dataclass
class EpochContext:
    """What an epoch hook gets.

    ``model``: the unwrapped model (backbone + plug-ins); call ``model.eval()``
    / ``model.train()`` as needed (the loop restores training mode after
    the hooks).  ``train_batches()``: a fresh iterator over this rank's share
    of the training split, batches already on ``device`` (every video once
    per rank, in a fixed order).  ``all_reduce(t, op)``: sums (``"sum"``) or
    takes the maximum (``"max"``) of ``t`` over the DDP ranks, in place
    semantics not required (the result is returned); identity on one rank.
    ``process_group``: the DDP group (None on one rank) for anything else.
    ``truth``: the training split's :class:`~prvrlab.data.truth.RelevanceTruth`
    on synthetic collections (None on real data), for diagnostic metrics only.
    """

    epoch: int
    num_epochs: int
    model: nn.Module
    device: torch.device
    amp_dtype: torch.dtype | None
    rank: int
    world_size: int
    train_batches: Callable[[], Iterator[Any]]
    all_reduce: Callable[..., Tensor] = _identity_reduce
    process_group: Any = None
    truth: Any = None

    def autocast(self):
        """The loop's autocast context for encoding (disabled without AMP)."""
        return torch.autocast(self.device.type, dtype=self.amp_dtype or torch.float32, enabled=self.amp_dtype is not None)

    def encode(self, batch: Any) -> tuple[Any, Any]:
        """(VideoEmbedding, QueryEmbedding) of a training batch with the current model: eval mode
        (no dropout), no gradient, the training-time capabilities exposed, under the loop's autocast."""
        self.model.eval()
        with torch.no_grad(), self.model.training_exposure(), self.autocast():
            video = self.model.encode_videos(batch.clips, batch.frames, batch.frame_mask)
            query = self.model.encode_queries(batch.queries, batch.query_mask)
        return video, query


@dataclass
class StepContext:
    """What :meth:`Component.on_step_end` gets, after the optimiser step."""

    epoch: int
    step: int  # step within the epoch (0-based)
    global_step: int  # steps since the start of training (0-based)
    batch: Any  # the Batch just trained on
    output: Any  # its ModelOutput
    terms: dict[str, Tensor]  # unweighted, detached loss terms
    truth: Any = None  # the training split's RelevanceTruth (synthetic data only), for diagnostics
    # DDP ranks holding this same batch and output (the world size under train.ddp_batch: global, else 1):
    # a count summed over the ranks by an epoch hook counts this step that many times
    ranks: int = 1


# ---------------------------------------------------------------- the base class


class Component(nn.Module):
    """Base of every loss and plug-in: needs, hooks and metrics (all default to nothing)."""

    # Constructor parameters added after configs using the component were run -> the value that does what
    # it did before; a config holding that value leaves the key out of its hash (``config_hash``), so
    # earlier runs and finished ablation cells keep matching it.
    hash_neutral: ClassVar[dict[str, Any]] = {}
    # Parameter values of the ``corrected`` preset (``--preset corrected``): prvrlab's corrected behaviour
    # where this component's official default reproduces a reference defect (docs/parity.md).
    corrected: ClassVar[dict[str, Any]] = {}
    # Parameters of a loss or plug-in that act only while another of its parameters has one of some values:
    # {param: {other: (values...)}}. A search spec that searches ``param`` while ``other`` is fixed at
    # another value, or searched without a ``when`` drawing it only then, is refused (every such trial would
    # differ in a value nothing reads).
    applies_when: ClassVar[dict[str, dict[str, tuple[Any, ...]]]] = {}

    def needs(self, *, training: bool) -> frozenset[str]:
        """Capabilities (names in :data:`CAPABILITIES`) needed at training / retrieval time."""
        return frozenset()

    def metric_names(self) -> tuple[str, ...]:
        """Metrics this component reports every epoch (``train/<component>.<name>``)."""
        return ()

    def on_epoch_start(self, ctx: EpochContext) -> dict[str, float]:
        """Called on every rank before the epoch's first step; returns metrics to log."""
        return {}

    def on_step_end(self, ctx: StepContext) -> None:
        """Called on every rank after every optimiser step."""

    def on_epoch_end(self, ctx: EpochContext) -> dict[str, float]:
        """Called on every rank after the epoch's last step (before validation); returns metrics."""
        return {}

    def log_metric(self, name: str, value: Tensor | float) -> None:
        """Record a scalar for this step; the loop averages it over the epoch's steps and ranks.

        A tensor stays where it is (detached): the loop sums it on its device, so logging
        never makes the host wait for a GPU."""
        metrics = self.__dict__.setdefault("_step_metrics", {})
        metrics[name] = value.detach().reshape(()) if isinstance(value, Tensor) else float(value)

    def pop_step_metrics(self) -> dict[str, Tensor | float]:
        """The metrics logged since the last call (the loop calls this once per step): floats, or
        0-d tensors for values logged as tensors."""
        return self.__dict__.pop("_step_metrics", {})

    def log_distribution(self, name: str, series: dict[str, Tensor], *, low: float, high: float, bins: int = 50) -> None:
        """Record the values of named series (1-D tensors) of one quantity from an epoch hook.

        The loop histograms them over ``bins`` equal bins of [low, high] (values
        outside count in the end bins) and writes ``distributions/<component>.<name>.json``
        (:func:`histogram_record`).  Under DDP every rank must log the same names and series.
        """
        if not (high > low and bins >= 1):
            raise ValueError(f"log_distribution {name!r}: needs low < high and bins >= 1, got {low}, {high}, {bins}")
        pending = self.__dict__.setdefault("_distributions", {})
        pending[name] = (dict(series), float(low), float(high), int(bins))

    def pop_distributions(self) -> dict[str, tuple[dict[str, Tensor], float, float, int]]:
        """The distributions logged since the last call (the loop calls this after every epoch hook)."""
        return self.__dict__.pop("_distributions", {})


DISTRIBUTIONS_DIR = "distributions"  # run artifact folder of the logged distributions (one JSON per name)


def histogram_record(
    series: dict[str, Tensor], *, low: float, high: float, bins: int, all_reduce: Callable[..., Tensor] = _identity_reduce
) -> dict[str, Any]:
    """The artifact of one distribution, summed over the ranks by ``all_reduce``::

        {"edges": [bins + 1 floats], "series": {name: {"counts": [bins ints], "n": int, "mean": float, "std": float}}}

    ``mean`` / ``std`` are of the values themselves (not of the bins); NaN when a series is empty.
    """
    edges = torch.linspace(low, high, bins + 1, dtype=torch.float64)
    out: dict[str, Any] = {"edges": edges.tolist(), "series": {}}
    for key, values in series.items():
        v = values.detach().reshape(-1).double()  # (N,)
        counts = torch.histc(v.clamp(low, high), bins=bins, min=low, max=high)  # (bins,)
        moments = torch.stack([v.new_tensor(float(v.numel())), v.sum(), (v * v).sum()])  # (3,)
        total = all_reduce(torch.cat([counts, moments]))
        counts, (n, first, second) = total[:bins], total[bins:].tolist()
        mean = first / n if n else float("nan")
        var = max(second / n - mean * mean, 0.0) if n else float("nan")
        out["series"][key] = {"counts": [int(c) for c in counts.round().tolist()], "n": int(n), "mean": mean, "std": var**0.5}
    return out
