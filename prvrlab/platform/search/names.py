"""Short, distinctive MLflow names for the child runs of a study.

- search: ``trial 3 · lr=3e-4 clip_nce.weight=0.05`` — the trial number
  (1, 2, ... in the order the trials started; Tune's ids of searcher-made
  trials carry no number) and the sampled values, each key without its
  config section (kept where two keys of the space would read the same);
- ablation: ``<variant> · seed 1``.

A name holds at most :data:`NAME_LIMIT` characters: a search name keeps the
values that fit whole and ends with ``…`` (the run's params and its
``prvrlab.sampled`` tag keep them all), an ablation name shortens the
variant, never the seed.  MLflow stores a run name in a 250-character column
(PostgreSQL and strict MySQL refuse a longer one).
"""

from __future__ import annotations

import math
from typing import Any, Iterable

SEP = " · "
NAME_LIMIT = 120  # characters; the MLflow runs table shows about 20, its store holds 250
MORE = "…"


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


def search_run_name(number: int, config: dict[str, Any], shortened: dict[str, str], *, digits: int = 1) -> str:
    """``trial 3 · lr=3e-4 K=5`` (keys not in ``shortened`` are shown in full), the values that fit
    :data:`NAME_LIMIT` whole, then ``…`` when some did not.  ``digits``: the number is zero-padded to
    that width (``trial 03`` of 12), so sorting the runs by name keeps their start order."""
    name = f"trial {number:0{digits}d}"
    values = [f"{shortened.get(k, k)}={compact(v)}" for k, v in config.items()]
    kept: list[str] = []
    for i, value in enumerate(values):
        room = NAME_LIMIT - (len(MORE) + 1 if i < len(values) - 1 else 0)  # room for " …" unless this is the last
        if len(name + SEP + " ".join(kept + [value])) > room:
            return name + SEP + " ".join(kept + [MORE]) if kept else name + SEP + MORE
        kept.append(value)
    return name + (SEP + " ".join(kept) if kept else "")


def ablation_run_name(variant: str, seed: int) -> str:
    """``<variant> · seed 1``; a variant too long for :data:`NAME_LIMIT` is cut, ending with ``…``."""
    tail = f"{SEP}seed {seed}"
    if len(variant) + len(tail) > NAME_LIMIT:
        variant = variant[: max(NAME_LIMIT - len(tail) - len(MORE), 1)] + MORE
    return variant + tail
