"""Evaluate a saved model (``best_model.pt``) on any split of its collection."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from prvrlab.data.errors import DataError
from prvrlab.platform.config import ConfigError, validate

# What a config meant before the reference-parity switches existed (their defaults are now the
# official code's behaviour).  A checkpoint written before then (no "format" key) stored a config
# without these keys; it is evaluated with the behaviour it was trained with.
PRE_PARITY_BEHAVIOUR: dict[str, dict[str, object]] = {
    "model": {"window": "centred", "window_length": "real"},
    "data": {"last_bin": "inclusive"},
    "train": {"warmup": "shifted", "clip_grad": "global", "early_stop": "at_patience"},
    "plugins.ral": {"mean_proxy": True, "csa_input": "raw", "unit_mean": False},
    "loss:ral_pm": {"formulation": "paper"},
    "loss:ral_da": {"formulation": "paper"},
}


def upgrade_stored_config(raw: dict) -> dict:
    """A pre-format-2 stored config with every parity switch it lacks set to the old behaviour
    (only for components that have the switch: a backbone without ``window`` gets none)."""
    from prvrlab.registry import BACKBONES, LOSSES

    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    model = out.get("model") or {}
    known = BACKBONES.params(model["name"]) if "name" in model else {}
    for key, value in PRE_PARITY_BEHAVIOUR["model"].items():
        if key in known:
            model.setdefault(key, value)
    for section in ("data", "train"):
        target = out.setdefault(section, {}) or {}
        out[section] = {**PRE_PARITY_BEHAVIOUR[section], **target}
    plugins = {name: dict(params or {}) for name, params in (out.get("plugins") or {}).items()}
    if "ral" in plugins:
        plugins["ral"] = {**PRE_PARITY_BEHAVIOUR["plugins.ral"], **plugins["ral"]}
    out["plugins"] = plugins
    losses = {}
    for term, spec in (out.get("losses") or {}).items():
        spec = dict(spec)
        old = PRE_PARITY_BEHAVIOUR.get(f"loss:{spec.get('loss', term)}", {})
        losses[term] = {**{k: v for k, v in old.items() if k in LOSSES.params(spec.get("loss", term))}, **spec}
    out["losses"] = losses
    return out


def load_checkpoint(path: str | Path) -> dict:
    """Read a model file written by training; a clear error when it is not one."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"checkpoint not found: {path}")
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise DataError(f"{path}: not a readable prvrlab checkpoint ({type(exc).__name__}: {exc})") from None
    if not isinstance(blob, dict) or "model" not in blob or "config" not in blob:
        raise DataError(f"{path}: not a prvrlab checkpoint (expected keys 'model' and 'config')")
    return blob


def evaluate_checkpoint(
    path: str | Path,
    *,
    split: str,
    data_root: str | None = None,
    ranks_out: str | None = None,
    amp: str = "none",
):
    """Evaluate the model in ``path`` on ``split``; optionally write per-query ranks."""
    from prvrlab.data.collection import open_collection
    from prvrlab.evaluation.metrics import save_ranks
    from prvrlab.evaluation.retrieval import evaluate, resolve_amp_dtype
    from prvrlab.models.factory import build_model

    blob = load_checkpoint(path)
    stored = blob["config"] if blob.get("format", 1) >= 2 else upgrade_stored_config(blob["config"])
    try:
        cfg = validate(stored)
    except ConfigError as exc:
        raise ConfigError(f"{path}: stored config is invalid: {exc}") from None
    if data_root is not None:
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, root=str(Path(data_root).resolve())))
    collection = open_collection(cfg.data)
    collection.split(split)
    model = build_model(cfg.model, cfg.plugins, video_dim=collection.video_dim, query_dim=collection.query_dim)
    try:
        model.load_state_dict(blob["model"])
    except RuntimeError as exc:
        raise DataError(f"{path}: weights do not fit the configured model: {exc}") from None
    device = torch.device("cpu")
    result = evaluate(model, collection, split, cfg.eval, device=device, amp_dtype=resolve_amp_dtype(amp))
    if ranks_out:
        save_ranks(Path(ranks_out), result.table)
    return result
