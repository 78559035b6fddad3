"""A named, weighted sum of loss terms built from the config's ``losses`` mapping.

``losses: {clip_trip: {loss: triplet, weight: 1.0, branch: clip}, ...}``
becomes ``total = sum_t weight_t * term_t``; terms of weight 0 are not computed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from prvrlab.checks import check_number
from prvrlab.data.batch import Batch
from prvrlab.losses.base import Loss
from prvrlab.models.base import ModelOutput
from prvrlab.registry import LOSSES


class NonFiniteLossError(FloatingPointError):
    """The total loss is NaN or infinite; ``terms`` names the offending term(s).

    ``epoch`` is the loop's (from 0); the message counts from 1, as every report does.
    """

    def __init__(self, terms: list[str], values: dict[str, float], epoch: int) -> None:
        self.terms = terms
        self.values = values
        self.epoch = epoch
        shown = ", ".join(f"{t}={values[t]!r}" for t in terms)
        super().__init__(f"non-finite loss at epoch {epoch + 1}: term(s) {', '.join(terms)} ({shown})")


@dataclass
class LossResult:
    """The weighted total (to backpropagate) and the unweighted, detached terms."""

    total: Tensor
    terms: dict[str, Tensor] = field(default_factory=dict)

    def non_finite(self) -> Tensor:
        """A (1,) float flag, 1 where the total is NaN or infinite; computed where the total lives
        (no host sync), so ranks can all-reduce it before reading it once."""
        return (~torch.isfinite(self.total.detach())).float().reshape(1)

    def check_finite(self, epoch: int) -> None:
        """Raise :class:`NonFiniteLossError`, naming the offending term(s), when the total is not finite."""
        if not self.non_finite().item():
            return
        values = {t: float(v) for t, v in self.terms.items()}
        bad = [t for t, v in values.items() if not math.isfinite(v)] or list(values)
        raise NonFiniteLossError(bad, values, epoch)


class WeightedLoss(nn.Module):
    """``total = sum_t weights[t] * losses[t](out, batch, epoch=epoch)`` over named terms."""

    def __init__(self, *, losses: Mapping[str, Loss], weights: Mapping[str, float]) -> None:
        super().__init__()
        if set(losses) != set(weights):
            raise ValueError(f"losses {sorted(losses)} and weights {sorted(weights)} must name the same terms")
        if not losses:
            raise ValueError("losses must hold at least one term")
        for term, weight in weights.items():
            if not term or "." in term:
                raise ValueError(f"loss term name {term!r} must be non-empty and contain no '.'")
            check_number(weight, f"weight of loss term '{term}'", minimum=0.0)
        if all(weight == 0 for weight in weights.values()):
            raise ValueError("every loss weight is 0; nothing would be trained")
        self.losses = nn.ModuleDict(dict(losses))
        self.weights = {term: float(weights[term]) for term in losses}

    @classmethod
    def from_config(cls, losses: Mapping[str, Mapping[str, Any]]) -> "WeightedLoss":
        """Build from ``{term: {"loss": name, "weight": w, **params}}`` (``loss`` defaults to the term)."""
        modules: dict[str, Loss] = {}
        weights: dict[str, float] = {}
        for term, spec in losses.items():
            params = {k: v for k, v in spec.items() if k not in ("loss", "weight")}
            modules[term] = LOSSES.build(spec.get("loss", term), **params)
            weights[term] = spec.get("weight", 1.0)
        return cls(losses=modules, weights=weights)

    def forward(self, out: ModelOutput, batch: Batch, *, epoch: int) -> LossResult:
        """Compute every term of non-zero weight.

        A non-finite total is returned as is (checking it here would make the host wait for
        the device at every step): the caller checks, with :meth:`LossResult.check_finite`, or
        the training loop once per step for all ranks together."""
        total: Tensor | None = None
        terms: dict[str, Tensor] = {}
        for term, loss in self.losses.items():
            weight = self.weights[term]
            if weight == 0.0:
                continue
            value = loss(out, batch, epoch=epoch)
            terms[term] = value.detach()
            part = value * weight
            total = part if total is None else total + part
        assert total is not None  # the constructor guarantees a non-zero weight
        return LossResult(total=total, terms=terms)
