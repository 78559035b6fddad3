"""Figures beside the report (matplotlib, Agg backend, deterministic file names).

Every figure has a title, axis labels and a legend naming each line and marker.

- ``sensitivity_<key>.png``: SumR against the value of one swept hyperparameter
  (every trial / seed as a dot, the mean per value or per bin of the report's
  table as a line);
- ``learning_curves.png``: a per-epoch metric of the best trials (integer epochs);
- ``distribution_<component>.<name>.png``: a logged distribution's series as
  density step lines, one panel per variant.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

_META = {"Software": None}  # no version string in the PNG


def _save(fig: plt.Figure, path: Path) -> Path:
    """Write ``fig`` to ``path`` (its folder made; no matplotlib version string in the file) and close it."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, metadata=_META)
    plt.close(fig)
    return path


def safe_name(key: str) -> str:
    """A file-name-safe form of a config key or study name ('losses.qd.weight' -> 'losses.qd.weight'); never
    empty, '.' or '..' (a name of dots alone, such as a study tagged '..', would name a folder above)."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", key)
    return name if name.strip(".") else name.replace(".", "_") or "_"


def sensitivity_plot(
    key: str,
    points: Sequence[tuple[Any, float]],
    path: Path,
    *,
    means: Sequence[tuple[Any, float]] | None = None,
    binned: bool = False,
    log: bool = False,
    categorical: bool = False,
    ylabel: str = "SumR",
    title: str | None = None,
) -> Path:
    """Dots per (value, SumR) point and a line through ``means`` (x, mean): the per-value or per-bin means
    of the report's table (default: the mean per distinct value of ``points``)."""
    if means is None:
        by_value: dict[Any, list[float]] = {}
        for v, y in points:
            by_value.setdefault(str(v) if categorical else float(v), []).append(float(y))
        means = [(v, sum(ys) / len(ys)) for v, ys in by_value.items()]
    fig, ax = plt.subplots(figsize=(4.6, 3.4), dpi=120)
    if categorical:
        labels = sorted({str(v) for v, _ in points} | {str(v) for v, _ in means}, key=_natural)
        pos = {lab: i for i, lab in enumerate(labels)}
        xs = [pos[str(v)] for v, _ in points]
        line = sorted((pos[str(v)], y) for v, y in means)
        ax.set_xticks(range(len(labels)), labels)
    else:
        xs = [float(v) for v, _ in points]
        line = sorted((float(v), float(y)) for v, y in means)
    ax.scatter(xs, [float(y) for _, y in points], s=18, alpha=0.7, color="tab:blue", zorder=3, label="one run")
    ax.plot([x for x, _ in line], [y for _, y in line], color="tab:orange", marker="o", ms=4, lw=1.2, zorder=2,
            label="mean per bin (table)" if binned else "mean per value (table)")
    if log and not categorical:
        ax.set_xscale("log")
    ax.set_xlabel(key + (" (bin centre for the mean)" if binned else ""))
    ax.set_ylabel(ylabel)
    ax.set_title(title or f"{ylabel} against {key}", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path)


def learning_curves(
    curves: Sequence[tuple[str, Sequence[tuple[int, float]]]],
    path: Path,
    *,
    ylabel: str = "val SumR",
    title: str | None = None,
) -> Path:
    """One line per (label, [(epoch, value), ...]); epochs count from 1, on integer ticks."""
    fig, ax = plt.subplots(figsize=(4.8, 3.4), dpi=120)
    for label, points in curves:
        if points:
            ax.plot([s for s, _ in points], [v for _, v in points], marker="o", ms=3, lw=1.2, label=label)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("epoch")
    ax.set_ylabel(ylabel)
    ax.set_title(title or f"{ylabel} per epoch", fontsize=9)
    ax.grid(True, alpha=0.3)
    if any(points for _, points in curves):
        ax.legend(fontsize=7, title="trial", title_fontsize=7)
    return _save(fig, path)


def distribution_plot(
    panels: Sequence[tuple[str, Sequence[float], dict[str, Sequence[float]]]],
    path: Path,
    *,
    xlabel: str,
    title: str,
) -> Path:
    """One panel per (label, bin edges, {series: counts}), each series a density step line; the x range is
    trimmed to the bins any panel fills."""
    filled = [(edges[i], edges[i + 1]) for _, edges, series in panels for counts in series.values()
              for i, c in enumerate(counts) if c > 0]  # each panel's own edges (they may differ between panels)
    fig, axes = plt.subplots(1, len(panels), figsize=(2.6 * len(panels) + 0.6, 2.8), dpi=120, sharex=True, squeeze=False)
    for ax, (label, edges, series) in zip(axes[0], panels):
        for name, counts in series.items():
            total = sum(counts)
            if total:
                density = [c / total / (edges[i + 1] - edges[i]) for i, c in enumerate(counts)]
                ax.stairs(density, edges, label=f"{name} (n={total:,})")
        if filled:
            ax.set_xlim(min(lo for lo, _ in filled), max(hi for _, hi in filled))
        ax.set_title(label, fontsize=8)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6)
    axes[0][0].set_ylabel("density")
    fig.suptitle(title, fontsize=9)
    return _save(fig, path)


def _natural(text: str):
    try:
        return (0, float(text), text)
    except ValueError:
        return (1, 0.0, text)
