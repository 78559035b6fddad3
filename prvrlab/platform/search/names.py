"""Short, distinctive MLflow names for the child runs of a study.

- search: ``trial 3 · lr=3e-4 clip_nce.weight=0.05`` — the trial number
  (1, 2, ... in the order the trials started; Tune's ids of searcher-made
  trials carry no number) and the sampled values, each key without its
  config section (kept where two keys of the space would read the same);
- ablation: ``<variant> · seed 1``.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

SEP = " · "


def short_keys(keys: Iterable[str]) -> dict[str, str]:
    """Dotted key -> the key without its section (``train.``, ``losses.`` ...), or the whole key
    where two keys would read the same.

    >>> short_keys(["train.lr", "losses.clip_nce.weight", "model.dropout", "train.dropout"])
    {'train.lr': 'lr', 'losses.clip_nce.weight': 'clip_nce.weight', 'model.dropout': 'model.dropout', 'train.dropout': 'train.dropout'}
    """
    keys = list(dict.fromkeys(keys))
    tails = [k.split(".", 1)[-1] for k in keys]
    return {k: t if tails.count(t) == 1 else k for k, t in zip(keys, tails)}


def compact(value: Any) -> str:
    """A value in few characters, floats to 2 significant digits (the MLflow runs table shows
    about 20 characters of a name; the run's params keep the exact value):
    ``3e-4``, ``7.3e-4``, ``0.062``, ``128``, ``true``."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        if value == 0 or not math.isfinite(value):
            return f"{value:g}"
        if abs(value) < 1e-2 or abs(value) >= 1e5:
            mantissa, exponent = f"{value:.1e}".split("e")
            return f"{float(mantissa):g}e{int(exponent)}"
        return f"{round(value)}" if abs(value) >= 10 else f"{value:.2g}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(compact(v) for v in value) + "]"
    return str(value)


def search_run_name(number: int, config: dict[str, Any], shortened: dict[str, str]) -> str:
    """``trial 3 · lr=3e-4 K=5`` (keys not in ``shortened`` are shown in full)."""
    values = " ".join(f"{shortened.get(k, k)}={compact(v)}" for k, v in config.items())
    return f"trial {number}" + (SEP + values if values else "")


def ablation_run_name(variant: str, seed: int) -> str:
    """``<variant> · seed 1``."""
    return f"{variant}{SEP}seed {seed}"
