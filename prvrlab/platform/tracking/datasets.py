"""The data collection of a run as an MLflow dataset input (metadata only, no feature upload).

MLflow shows it in the runs table's "Dataset" column and on the run page:
the collection's name, its root folder as the source, a digest and a
profile (split sizes, feature dimensions, the feature store).

The digest is the first 12 hex digits of a SHA-256 over the files the
run reads: files up to 16 MiB (captions, ``id.txt``, ``shape.txt``,
``video2frames.txt``) by content, larger ones (``feature.bin``, HDF5
stores) by name and size only, so that logging it costs milliseconds even
for TVR (choice: reading 20 GB of features per run to hash them is not
worth it; the NaN scan of :mod:`prvrlab.data.integrity` reads them once).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from mlflow.data.meta_dataset import MetaDataset
from mlflow.data.sources import LocalArtifactDatasetSource

CONTENT_LIMIT = 16 << 20  # bytes: larger files enter the digest by name and size


class CollectionDataset(MetaDataset):
    """A :class:`MetaDataset` that also carries a profile (split sizes, dimensions)."""

    def __init__(self, *, root: str, name: str, digest: str, profile: dict[str, Any]) -> None:
        self._profile = profile
        super().__init__(LocalArtifactDatasetSource(root), name=name, digest=digest)

    @property
    def profile(self) -> dict[str, Any]:
        """Split sizes, feature dimensions and the feature store."""
        return self._profile

    def to_dict(self) -> dict[str, str]:
        """MetaDataset's fields plus the profile as JSON."""
        return {**super().to_dict(), "profile": json.dumps(self._profile, sort_keys=True)}


def _files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]


def data_digest(paths: list[Path]) -> str:
    """SHA-256 (12 hex digits) over ``paths`` (folders: every file in them): small files by
    content, files over CONTENT_LIMIT by name and size."""
    digest = hashlib.sha256()
    for top in paths:
        for path in _files(top):
            size = path.stat().st_size
            digest.update(f"{path.name}\0{size}\0".encode())
            if size <= CONTENT_LIMIT:
                digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def collection_dataset(collection, splits: list[str]) -> CollectionDataset:
    """The MLflow dataset of an open :class:`~prvrlab.data.collection.Collection` used with ``splits``."""
    indexes = {name: collection.split(name) for name in splits}
    profile = {
        "splits": {name: {"videos": ix.num_videos, "queries": ix.num_queries} for name, ix in indexes.items()},
        "visual_feature": collection.visual.path.name,
        "video_dim": collection.video_dim,
        "query_dim": collection.query_dim,
        "videos_in_store": len(collection.visual),
    }
    files = [collection.visual.path, collection.queries.path, *(ix.caption_file for ix in indexes.values())]
    return CollectionDataset(root=str(collection.root), name=collection.name, digest=data_digest(files), profile=profile)


def dataset_of(data_cfg) -> CollectionDataset:
    """The dataset of a run's ``data`` config (the collection is opened, its splits indexed, then closed)."""
    from prvrlab.data.collection import configured_splits, open_collection

    collection = open_collection(data_cfg, allow_synthesize=False)
    try:
        return collection_dataset(collection, configured_splits(data_cfg))
    finally:
        collection.close()
