"""The data layer: feature readers, preprocessing, loaders, synthetic data.

Public entry points::

    open_collection(cfg) -> Collection          paths from a DataConfig, validated
    VideoDataset, collate, VideoBatchSampler    training samples -> Batch
    train_loader, video_batches, query_batches  loaders for training and evaluation
    synthesize(out_root, preset=...)            a synthetic collection on disk
    convert_bigfile(src, dst)                   BigFile folder -> HDF5
    inspect_collection(cfg)                     validate and summarise

Submodules load on first use (``prvrlab.data.X``), so importing a light part
(``prvrlab.data.config``) does not pull torch into a process that never trains.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Batch": "batch",
    "BigFile": "bigfile",
    "Collection": "collection",
    "SplitIndex": "collection",
    "open_collection": "collection",
    "convert_bigfile": "convert",
    "VideoBatchSampler": "dataset",
    "VideoDataset": "dataset",
    "VideoItem": "dataset",
    "collate": "dataset",
    "query_batches": "dataset",
    "train_loader": "dataset",
    "video_batches": "dataset",
    "DataError": "errors",
    "HDF5Features": "features",
    "VisualFeatures": "features",
    "open_visual_features": "features",
    "InspectReport": "inspect",
    "inspect_collection": "inspect",
    "PRESETS": "synth",
    "SynthPreset": "synth",
    "synthesize": "synth",
    "QueryFeatures": "text",
    "read_captions": "text",
    "read_timestamps": "text",
    "video_id_of": "text",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
