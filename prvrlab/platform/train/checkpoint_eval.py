"""Evaluate a saved model on any split of its collection: a run's ``best_model.pt`` (weights and the
config they were trained with), or a recovery checkpoint (``state.pt``, or the ``checkpoint_*`` folder
holding it: the weights of the last reported epoch, no config) with the run's ``config.yaml``."""

from __future__ import annotations

import dataclasses
import zipfile
from pathlib import Path

import torch

from prvrlab.data.errors import DataError
from prvrlab.platform.config import ConfigError, ExperimentConfig, validate
from prvrlab.platform.presets import stored_behaviour

EXPECTED = "expected a best_model.pt written by prvrlab training, or a recovery checkpoint (state.pt)"
RECOVERY_FILE = "state.pt"  # a recovery checkpoint's file in its checkpoint_* folder
BEST_FILE = "best_model.pt"  # the best validation epoch's model in a run's files
# where a run's config.yaml lies from its recovery checkpoint's folder, in the layouts training writes
RECOVERY_CONFIGS = (
    ("..", "..", "config.yaml"),  # <run files>/local_session/checkpoint_latest/state.pt (train --no-ray)
    ("..", "files", "config.yaml"),  # <storage>/<run>/checkpoint_<time>/state.pt (Ray Train)
)  # and a study trial's Tune checkpoint (_trial_config)


def checkpoint_file(path: str | Path) -> Path:
    """The model file ``path`` names: the file itself; in a folder, its ``state.pt`` (a checkpoint
    folder), else its ``best_model.pt`` (a run's files), else ``files/best_model.pt`` (the run's folder
    that training prints)."""
    path = Path(path)
    if path.is_dir():
        for name in (RECOVERY_FILE, BEST_FILE, f"files/{BEST_FILE}"):
            if (path / name).is_file():
                return path / name
        held = sorted(d.name for d in path.glob("checkpoint_*") if (d / RECOVERY_FILE).is_file())
        where = f"; its recovery checkpoints: {', '.join(held)}" if held else ""
        raise DataError(f"{path}: a folder without {RECOVERY_FILE} or {BEST_FILE} (nor files/{BEST_FILE}){where}: {EXPECTED}")
    return path


def recovery_config(path: Path) -> Path | None:
    """The ``config.yaml`` of the run whose recovery checkpoint is ``path``, where training puts it; else None."""
    for parts in RECOVERY_CONFIGS:
        candidate = path.parent.joinpath(*parts).resolve()
        if candidate.is_file():
            return candidate
    return _trial_config(path.parent.resolve())


def _trial_config(folder: Path) -> Path | None:
    """A study trial's ``config.yaml`` for its Tune checkpoint ``<study>/tune/<trial folder>/checkpoint_*``:
    ``<study>/trials/<id>/files/config.yaml`` of the one trial id that Tune's folder name holds as ``_<id>_``."""
    tune_trial = folder.parent
    trials = tune_trial.parent.parent / "trials"
    if tune_trial.parent.name != "tune" or not trials.is_dir():
        return None
    found = [d / "files" / "config.yaml" for d in trials.iterdir() if f"_{d.name}_" in tune_trial.name]
    return found[0] if len(found) == 1 and found[0].is_file() else None


def load_checkpoint(path: str | Path, *, config: str | Path | None = None) -> dict:
    """Read a model file written by training; a clear error when it is not one.

    A recovery checkpoint holds no config: it is read from ``config`` (a YAML file), else from the
    run's ``config.yaml`` where training writes it, and the returned blob carries it (``config``,
    the current ``format``, ``epoch`` from its progress and ``config_file``).  ``config`` is refused
    for a ``best_model.pt``, which holds the config its weights were trained with."""
    path = checkpoint_file(path)
    if not path.is_file():
        raise DataError(f"checkpoint not found: {path}")
    if not zipfile.is_zipfile(path):
        raise DataError(f"{path}: not a prvrlab checkpoint: {EXPECTED} (a PyTorch zip archive)")
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch's text may advise weights_only=False, which runs the file's code
        raise DataError(f"{path}: not a readable prvrlab checkpoint: {EXPECTED} (torch.load: {type(exc).__name__})") from None
    if isinstance(blob, dict) and "model" in blob and "progress" in blob and "config" not in blob:
        return _with_run_config(_checked(blob, path), path, config)
    if not isinstance(blob, dict) or "model" not in blob or "config" not in blob:
        raise DataError(f"{path}: not a prvrlab checkpoint: {EXPECTED} (with keys 'model' and 'config')")
    if config is not None:
        raise ConfigError(f"--config {config}: {path} holds the config its weights were trained with; "
                          "--config is for a recovery checkpoint (state.pt)")
    return _checked(blob, path)


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _checked(blob: dict, path: Path) -> dict:
    """``blob`` when its entries have the types training writes and a format this prvrlab reads; else a DataError."""
    from prvrlab.platform.train.loop import CHECKPOINT_FORMAT

    fmt = blob.get("format", 1)
    if not _whole(fmt) or fmt < 1:
        raise DataError(f"{path}: not a prvrlab checkpoint: its 'format' is {fmt!r}, not a whole number >= 1")
    if fmt > CHECKPOINT_FORMAT:
        raise DataError(f"{path}: checkpoint format {fmt} was written by a newer prvrlab; this one reads formats "
                        f"1 to {CHECKPOINT_FORMAT} (upgrade prvrlab to evaluate it)")
    if "config" in blob and not isinstance(blob["config"], dict):
        raise DataError(f"{path}: not a prvrlab checkpoint: its 'config' is a {type(blob['config']).__name__}, not a mapping")
    weights = blob["model"]
    if not isinstance(weights, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in weights.items()):
        raise DataError(f"{path}: not a prvrlab checkpoint: its 'model' is not a state dict (parameter names to tensors)")
    if "epoch" in blob and (not _whole(blob["epoch"]) or blob["epoch"] < 0):
        raise DataError(f"{path}: not a prvrlab checkpoint: its 'epoch' is {blob['epoch']!r}, not a whole number >= 0")
    return blob


def weights_mismatch(model: torch.nn.Module, weights: dict, error: Exception) -> str:
    """What keeps ``weights`` from loading into ``model`` (which raised ``error``), in one line: for torch's
    key and shape report (every key, one per line), how many entries are missing, unexpected or of another
    shape, with the first of each, counted after the renames of earlier layouts that loading applies
    (``RetrievalModel.legacy_keys``); any other refusal (e.g. two entries of one shared tensor that differ)
    as it was given, on one line."""
    from prvrlab.models.base import RetrievalModel, rename_legacy_keys

    text = str(error)
    if not text.startswith("Error(s) in loading state_dict"):
        return " ".join(text.split())
    weights = dict(weights)
    for name, module in model.named_modules():
        if isinstance(module, RetrievalModel) and module.legacy_keys:
            rename_legacy_keys(weights, f"{name}." if name else "", module.legacy_keys)
    own = model.state_dict()
    missing = [k for k in own if k not in weights]
    unexpected = [k for k in weights if k not in own]
    shapes = [f"{k} {tuple(weights[k].shape)} vs {tuple(own[k].shape)}" for k in own if k in weights
              and tuple(weights[k].shape) != tuple(own[k].shape)]
    parts = [f"{len(keys)} {what} (first: {keys[0]})" for what, keys in
             (("missing", missing), ("unexpected", unexpected), ("of another shape", shapes)) if keys]
    return "; ".join(parts) or "the model refused them"


def _with_run_config(blob: dict, path: Path, config: str | Path | None) -> dict:
    """A recovery checkpoint's blob with its run's config (see :func:`load_checkpoint`)."""
    from prvrlab.platform.config import load_raw
    from prvrlab.platform.train.loop import CHECKPOINT_FORMAT

    if config is not None and not Path(config).is_file():
        raise ConfigError(f"--config {config}: file not found")
    source = Path(config) if config is not None else recovery_config(path)
    if source is None:
        raise ConfigError(f"{path}: a recovery checkpoint holds no config and no run's config.yaml lies where "
                          "training writes it; give it with --config <run folder>/files/config.yaml")
    try:
        epoch = int(blob["progress"]["epoch"])
    except (KeyError, TypeError, ValueError):
        raise DataError(f"{path}: not a prvrlab checkpoint: {EXPECTED} (its 'progress' has no epoch)") from None
    raw = load_raw(source)  # a config.yaml is the resolved config of the prvrlab that wrote it
    return {**blob, "config": raw, "format": CHECKPOINT_FORMAT, "epoch": epoch + 1, "config_file": str(source)}


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


def check_own_data(cfg: ExperimentConfig, path: str | Path) -> None:
    """The data root a checkpoint's config names, for an evaluation without ``--data-root``: it must exist (a
    checkpoint says where its data is, it never has a folder created: nothing it holds writes files) and hold
    the synthetic preset the config names, if any; DataError saying how to make it otherwise."""
    from prvrlab.data.collection import check_synthetic_root, collection_root

    if cfg.data.synthesize and not Path(cfg.data.root).exists():
        raise DataError(
            f"{path}: its data root {cfg.data.root} does not exist; write the model's synthetic collection there "
            f"with  prvrlab data synth --preset {cfg.data.synthesize} --seed {cfg.data.synth_seed} --out "
            f"{cfg.data.root}  (or give --data-root)"
        )
    check_synthetic_root(cfg.data, collection_root(cfg.data))


def eval_device(cfg: ExperimentConfig, requested: str | None = None) -> torch.device:
    """Where ``prvrlab eval`` runs the model of a run configured by ``cfg`` (:func:`saved_model_device`)."""
    from prvrlab.evaluation.retrieval import saved_model_device

    return saved_model_device(cfg.train.use_gpu, requested)


def evaluate_checkpoint(
    path: str | Path,
    *,
    split: str,
    data_root: str | None = None,
    ranks_out: str | None = None,
    amp: str = "none",
    config: str | Path | None = None,
    device: str | None = None,
    blob: dict | None = None,
):
    """Evaluate the model in ``path`` (see :func:`load_checkpoint`; ``config`` for a recovery checkpoint)
    on ``split`` on ``device`` (:func:`eval_device`); optionally write per-query ranks.  ``blob``: what
    :func:`load_checkpoint` already read from ``path`` (it is not read again)."""
    from prvrlab.allocator import primitive_cache_limit, set_host_allocator
    from prvrlab.data.collection import open_collection
    from prvrlab.data.integrity import check_visual_features
    from prvrlab.evaluation.metrics import save_ranks
    from prvrlab.evaluation.retrieval import evaluate, resolve_amp_dtype
    from prvrlab.models.factory import build_model
    from prvrlab.vector_math import settle_vector_math

    blob = blob if blob is not None else load_checkpoint(path, config=config)
    cfg = checkpoint_config(blob, path)
    if data_root is not None:
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, root=str(Path(data_root).resolve())))
    if data_root is None:
        check_own_data(cfg, path)
    collection = open_collection(cfg.data, allow_synthesize=False)  # a checkpoint's or given root: never written
    check_visual_features(collection.visual)  # a NaN frame would score -inf, silently (scanned once per data version)
    collection.split(split)
    model = build_model(cfg.model, cfg.plugins, video_dim=collection.video_dim, query_dim=collection.query_dim)
    try:
        model.load_state_dict(blob["model"])
    except RuntimeError as exc:
        raise DataError(f"{path}: weights do not fit the configured model: {weights_mismatch(model, blob['model'], exc)}") from None
    device = eval_device(cfg, device)
    model.to(device)
    set_host_allocator(cfg.train.host_allocator)
    settle_vector_math()  # before the first multi-threaded sqrt / exp / log: pytorch/pytorch#188792
    with primitive_cache_limit():  # one evaluation: the primitives of its batch shapes are not reused
        result = evaluate(
            model, collection, split, cfg.eval, device=device, amp_dtype=resolve_amp_dtype(amp), release_memory=True
        )
    if ranks_out:
        save_ranks(Path(ranks_out), result.table)
    return result
