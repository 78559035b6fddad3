"""The data layer: feature readers, preprocessing, loaders, synthetic data.

Public entry points::

    open_collection(cfg) -> Collection          paths from a DataConfig, validated
    VideoDataset, collate, VideoBatchSampler    training samples -> Batch
    train_loader, video_batches, query_batches  loaders for training and evaluation
    synthesize(out_root, preset=...)            a synthetic collection on disk
    convert_bigfile(src, dst)                   BigFile folder -> HDF5
    inspect_collection(cfg)                     validate and summarise
"""

from prvrlab.data.batch import Batch
from prvrlab.data.bigfile import BigFile
from prvrlab.data.collection import Collection, SplitIndex, open_collection
from prvrlab.data.convert import convert_bigfile
from prvrlab.data.dataset import (
    VideoBatchSampler,
    VideoDataset,
    VideoItem,
    collate,
    query_batches,
    train_loader,
    video_batches,
)
from prvrlab.data.errors import DataError
from prvrlab.data.features import HDF5Features, VisualFeatures, open_visual_features
from prvrlab.data.inspect import InspectReport, inspect_collection
from prvrlab.data.synth import PRESETS, SynthPreset, synthesize
from prvrlab.data.text import QueryFeatures, read_captions, read_timestamps, video_id_of

__all__ = [
    "Batch",
    "BigFile",
    "Collection",
    "DataError",
    "HDF5Features",
    "InspectReport",
    "PRESETS",
    "QueryFeatures",
    "SplitIndex",
    "SynthPreset",
    "VideoBatchSampler",
    "VideoDataset",
    "VideoItem",
    "VisualFeatures",
    "collate",
    "convert_bigfile",
    "inspect_collection",
    "open_collection",
    "open_visual_features",
    "query_batches",
    "read_captions",
    "read_timestamps",
    "synthesize",
    "train_loader",
    "video_batches",
    "video_id_of",
]
