"""Figures beside the report (matplotlib, Agg backend, deterministic file names).

- ``sensitivity_<key>.png``: SumR against the value of one swept hyperparameter
  (every trial / seed as a dot, the per-value mean as a line);
- ``learning_curves.png``: a per-epoch metric of the best trials.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

_META = {"Software": None}  # no version string in the PNG


def safe_name(key: str) -> str:
    """A file-name-safe form of a config key ('losses.qd.weight' -> 'losses.qd.weight')."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", key)


def sensitivity_plot(
    key: str,
    points: Sequence[tuple[Any, float]],
    path: Path,
    *,
    log: bool = False,
    categorical: bool = False,
    ylabel: str = "SumR",
) -> Path:
    """Dots per (value, SumR) point and the mean per distinct value as a line."""
    fig, ax = plt.subplots(figsize=(4.2, 3.0), dpi=120)
    if categorical:
        labels = sorted({str(v) for v, _ in points}, key=_natural)
        pos = {lab: i for i, lab in enumerate(labels)}
        xs = [pos[str(v)] for v, _ in points]
        ax.set_xticks(range(len(labels)), labels)
    else:
        xs = [float(v) for v, _ in points]
    ys = [float(y) for _, y in points]
    ax.scatter(xs, ys, s=18, alpha=0.7, color="tab:blue", zorder=3)
    means: dict[float, list[float]] = {}
    for x, y in zip(xs, ys):
        means.setdefault(x, []).append(y)
    mx = sorted(means)
    ax.plot(mx, [sum(means[x]) / len(means[x]) for x in mx], color="tab:orange", marker="o", ms=3, lw=1.2, zorder=2)
    if log and not categorical:
        ax.set_xscale("log")
    ax.set_xlabel(key)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, metadata=_META)
    plt.close(fig)
    return path


def learning_curves(curves: Sequence[tuple[str, Sequence[tuple[int, float]]]], path: Path, *, ylabel: str = "val SumR") -> Path:
    """One line per (label, [(epoch, value), ...]); epochs shown 1-based."""
    fig, ax = plt.subplots(figsize=(4.8, 3.2), dpi=120)
    for label, points in curves:
        if points:
            ax.plot([s + 1 for s, _ in points], [v for _, v in points], marker="o", ms=3, lw=1.2, label=label)
    ax.set_xlabel("epoch")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if curves:
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, metadata=_META)
    plt.close(fig)
    return path


def _natural(text: str):
    try:
        return (0, float(text), text)
    except ValueError:
        return (1, 0.0, text)
