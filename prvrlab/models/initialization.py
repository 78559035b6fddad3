"""Weight initialisation shared by the backbones and plug-ins (a leaf: the model base class re-draws a
copied encoder with it without importing the blocks)."""

from __future__ import annotations

from torch import nn


def init_normal_(module: nn.Module, std: float = 0.02) -> None:
    """Initialise the weights of every Linear, Embedding and Linear-like module (one flagged ``linear_like``,
    such as ``blocks.BranchLinear``: a ``weight`` and a ``bias`` that may be None) under ``module`` from
    N(0, std), and their biases to zero."""
    for m in module.modules():
        linear = isinstance(m, nn.Linear) or getattr(m, "linear_like", False)
        if linear or isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=std)
        if linear and m.bias is not None:
            nn.init.zeros_(m.bias)
