"""Evaluate a saved model (``best_model.pt``) on any split of its collection."""

from __future__ import annotations

import dataclasses
import zipfile
from pathlib import Path

import torch

from prvrlab.data.errors import DataError
from prvrlab.platform.config import ConfigError, ExperimentConfig, validate
from prvrlab.platform.presets import stored_behaviour

EXPECTED = "expected a best_model.pt written by prvrlab training"


def load_checkpoint(path: str | Path) -> dict:
    """Read a model file written by training; a clear error when it is not one."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"checkpoint not found: {path}")
    if not zipfile.is_zipfile(path):
        raise DataError(f"{path}: not a prvrlab checkpoint: {EXPECTED} (a PyTorch zip archive)")
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch's text may advise weights_only=False, which runs the file's code
        raise DataError(f"{path}: not a readable prvrlab checkpoint: {EXPECTED} (torch.load: {type(exc).__name__})") from None
    if not isinstance(blob, dict) or "model" not in blob or "config" not in blob:
        raise DataError(f"{path}: not a prvrlab checkpoint: {EXPECTED} (with keys 'model' and 'config')")
    return blob


def checkpoint_epoch(blob: dict) -> int | None:
    """The epoch a model file was saved at, counted from 1 (files before format 3 counted from 0)."""
    if "epoch" not in blob:
        return None
    return int(blob["epoch"]) + (1 if blob.get("format", 1) < 3 else 0)


def checkpoint_config(blob: dict, path: str | Path) -> ExperimentConfig:
    """The validated config a model file was trained with (files written before a switch existed: the
    behaviour they were trained with, ``presets.BEFORE_FORMAT``)."""
    stored = stored_behaviour(blob["config"], int(blob.get("format", 1)))
    try:
        return validate(stored)
    except ConfigError as exc:
        raise ConfigError(f"{path}: stored config is invalid: {exc}") from None


def evaluate_checkpoint(
    path: str | Path,
    *,
    split: str,
    data_root: str | None = None,
    ranks_out: str | None = None,
    amp: str = "none",
):
    """Evaluate the model in ``path`` on ``split``; optionally write per-query ranks."""
    from prvrlab.allocator import primitive_cache_limit, set_host_allocator
    from prvrlab.data.collection import open_collection
    from prvrlab.evaluation.metrics import save_ranks
    from prvrlab.evaluation.retrieval import evaluate, resolve_amp_dtype
    from prvrlab.models.factory import build_model

    blob = load_checkpoint(path)
    cfg = checkpoint_config(blob, path)
    if data_root is not None:
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, root=str(Path(data_root).resolve())))
    collection = open_collection(cfg.data, allow_synthesize=data_root is None)  # a given root is never written
    collection.split(split)
    model = build_model(cfg.model, cfg.plugins, video_dim=collection.video_dim, query_dim=collection.query_dim)
    try:
        model.load_state_dict(blob["model"])
    except RuntimeError as exc:
        raise DataError(f"{path}: weights do not fit the configured model: {exc}") from None
    device = torch.device("cpu")
    set_host_allocator(cfg.train.host_allocator)
    with primitive_cache_limit():  # one evaluation: the primitives of its batch shapes are not reused
        result = evaluate(
            model, collection, split, cfg.eval, device=device, amp_dtype=resolve_amp_dtype(amp), release_memory=True
        )
    if ranks_out:
        save_ranks(Path(ranks_out), result.table)
    return result
