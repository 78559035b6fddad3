"""A PRVR collection on disk: visual features, query features and caption splits.

:func:`open_collection` resolves the paths of a :class:`DataConfig`::

    <root>/FeatureData/<visual_feature>         BigFile folder or HDF5 file (absolute path: as is;
                                                not given: the only store under FeatureData/)
    <root>/TextData/<text_feature>              default roberta_<collection>_query_feat.hdf5
    <root>/TextData/<collection><split>.caption.txt
    <root>/TextData/<collection><split>.timestamps.json   optional, analysis only

where ``<root>`` is ``data.root``, or ``data.root/<collection>`` when the
collection sits in its own folder as in the public releases, and checks
them: a missing file, a caption whose video has no visual features,
a query without features, a dimension mismatch, an empty video or query all
raise :class:`DataError` naming the file and the id.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from prvrlab.data.errors import DataError
from prvrlab.data.features import VisualFeatures, open_visual_features
from prvrlab.data.preprocess import LastBin, Normalize
from prvrlab.data.truth import RelevanceTruth, truth_file_name
from prvrlab.data.text import (
    QueryFeatures,
    caption_path,
    missing_split_message,
    not_a_regular_file,
    moment_ratios,
    read_captions,
    read_timestamps,
    timestamps_path,
    video_id_of,
)
from prvrlab.registry import did_you_mean

if TYPE_CHECKING:
    from prvrlab.data.config import DataConfig


@dataclass(frozen=True)
class SplitIndex:
    """The videos and queries of one split, queries grouped contiguously per video.

    ``query_video[i]`` is the position in ``video_ids`` of query ``i``'s video;
    the queries of video ``v`` are ``query_ids[query_offsets[v]:query_offsets[v + 1]]``.
    Videos are in order of first appearance in the caption file, and a video's
    queries keep their caption-file order.
    """

    name: str
    caption_file: Path
    video_ids: list[str]
    query_ids: list[str]
    query_texts: list[str]
    query_video: np.ndarray  # (Nq,) int64
    query_offsets: np.ndarray  # (Nv + 1,) int64
    frame_counts: np.ndarray  # (Nv,) int64, raw frames per video
    token_counts: np.ndarray  # (Nq,) int64, raw tokens per query (before truncation)
    ratios: np.ndarray | None  # (Nq,) float64 moment/video duration, NaN where unknown; None without timestamps

    @property
    def num_videos(self) -> int:
        """Number of videos in the split."""
        return len(self.video_ids)

    @property
    def num_queries(self) -> int:
        """Number of queries in the split."""
        return len(self.query_ids)

    def queries_of(self, video: int) -> slice:
        """Positions of the queries of video number ``video``."""
        return slice(int(self.query_offsets[video]), int(self.query_offsets[video + 1]))

    def preprocessed_bytes(self, *, max_frames: int, num_clips: int, max_query_len: int, video_dim: int, query_dim: int) -> int:
        """Bytes of the split's preprocessed float32 frames, clips and query tokens (what ``data.resident`` holds)."""
        frames = int(np.minimum(self.frame_counts, max_frames).sum())
        tokens = int(np.minimum(self.token_counts, max_query_len).sum())
        return 4 * ((frames + self.num_videos * num_clips) * video_dim + tokens * query_dim)


class Collection:
    """Open feature stores plus lazily built, cached split indexes.

    Picklable (feature handles are reopened per process), so it can be sent to
    DataLoader workers and Ray actors.
    """

    def __init__(
        self,
        *,
        name: str,
        root: Path,
        visual_path: Path,
        query_path: Path,
        text_dir: Path,
        max_frames: int = 128,
        num_clips: int = 32,
        max_query_len: int = 30,
        last_bin: LastBin = "official",
        normalize: Normalize = "official",
    ) -> None:
        self.name = name
        self.root = root
        self.text_dir = text_dir
        self.max_frames = max_frames
        self.num_clips = num_clips
        self.max_query_len = max_query_len
        self.last_bin: LastBin = last_bin
        self.normalize: Normalize = normalize
        self.visual: VisualFeatures = open_visual_features(visual_path)
        self.queries = QueryFeatures(query_path)
        self._splits: dict[str, SplitIndex] = {}
        self._truth: dict[str, RelevanceTruth | None] = {}
        self.notes: list[str] = []  # how the paths were resolved, for the user

    @property
    def video_dim(self) -> int:
        """Visual feature dimension Dv."""
        return self.visual.dim

    @property
    def query_dim(self) -> int:
        """Query token feature dimension Dq."""
        return self.queries.dim

    def caption_file(self, split: str) -> Path:
        """Path of the caption file of ``split``."""
        return caption_path(self.text_dir, self.name, split)

    def timestamps_file(self, split: str) -> Path:
        """Path of the (optional) timestamps file of ``split``."""
        return timestamps_path(self.text_dir, self.name, split)

    def truth(self, split: str) -> RelevanceTruth | None:
        """Ground-truth relevance of ``split`` (synthetic collections only; None elsewhere)."""
        path = self.text_dir / truth_file_name(self.name, split)
        if split not in self._truth:
            self._truth[split] = RelevanceTruth.load(path) if path.is_file() else None
        return self._truth[split]

    def split(self, name: str) -> SplitIndex:
        """The validated index of split ``name`` (built once, then cached)."""
        if name not in self._splits:
            self._splits[name] = self._build_split(name)
        return self._splits[name]

    def close(self) -> None:
        """Close open feature handles (they reopen on demand)."""
        self.visual.close()
        self.queries.close()

    def _build_split(self, name: str) -> SplitIndex:
        path = self.caption_file(name)
        if not path.is_file():
            why = not_a_regular_file(path) if path.exists() else missing_split_message(self.text_dir, self.name, name)
            raise DataError(why)
        captions = read_captions(path)
        if not captions:
            raise DataError(f"{path}: no caption")
        cap_ids = [c for c, _ in captions]
        cap_videos = [video_id_of(c) for c in cap_ids]
        video_ids = list(dict.fromkeys(cap_videos))
        position = {v: i for i, v in enumerate(video_ids)}
        missing = [v for v in video_ids if not self.visual.has(v)]
        if missing:
            cap = cap_ids[cap_videos.index(missing[0])]
            raise DataError(
                f"{path}: caption {cap!r} refers to video {missing[0]!r}, which has no features in "
                f"{self.visual.path} ({len(missing)} of {len(video_ids)} videos missing)"
            )
        frame_counts = np.array([self.visual.num_frames(v) for v in video_ids], dtype=np.int64)
        empty = np.flatnonzero(frame_counts == 0)
        if empty.size:
            raise DataError(f"{self.visual.path}: video {video_ids[int(empty[0])]!r} has no frame")
        raw_video = np.fromiter(map(position.__getitem__, cap_videos), dtype=np.int64, count=len(cap_ids))
        order = np.argsort(raw_video, kind="stable")  # group queries by video, keep file order within
        query_ids = [cap_ids[i] for i in order]
        query_texts = [captions[i][1] for i in order]
        query_video = raw_video[order]
        offsets = np.zeros(len(video_ids) + 1, dtype=np.int64)
        np.cumsum(np.bincount(query_video, minlength=len(video_ids)), out=offsets[1:])
        token_counts = self.queries.check(query_ids, source=path)
        skipped: list[str] = []
        stamps = read_timestamps(self.timestamps_file(name), skipped=skipped)
        if skipped:
            self.notes.append(f"{self.timestamps_file(name)}: {len(skipped)} entr{'y is' if len(skipped) == 1 else 'ies are'} "
                              f"no moment, left out of the ratio groups (first: {skipped[0]})")
        ratios = moment_ratios(stamps, query_ids) if stamps is not None else None
        return SplitIndex(
            name=name,
            caption_file=path,
            video_ids=video_ids,
            query_ids=query_ids,
            query_texts=query_texts,
            query_video=query_video,
            query_offsets=offsets,
            frame_counts=frame_counts,
            token_counts=token_counts,
            ratios=ratios,
        )

    def __repr__(self) -> str:
        return (
            f"Collection({self.name!r}, root={str(self.root)!r}, videos={len(self.visual)}, "
            f"queries={len(self.queries)}, video_dim={self.video_dim}, query_dim={self.query_dim})"
        )


def collection_root(cfg: "DataConfig") -> Path:
    """``data.root``, or ``<root>/<collection>`` when that folder holds the collection (release layout)."""
    root = Path(cfg.root).expanduser()
    nested = root / cfg.collection
    if not (root / "TextData").is_dir() and (nested / "TextData").is_dir():
        return nested
    return root


def feature_candidates(feature_dir: Path) -> list[str]:
    """The visual feature stores under ``FeatureData/``: BigFile folders and HDF5 files, sorted."""
    if not feature_dir.is_dir():
        return []
    return sorted(
        p.name
        for p in feature_dir.iterdir()
        if (p.is_dir() and (p / "feature.bin").is_file()) or (p.is_file() and p.suffix in (".hdf5", ".h5"))
    )


def visual_feature_of(cfg: "DataConfig", root: Path, key: str = "data.visual_feature") -> tuple[str, str | None]:
    """``(visual_feature, note)``: the configured one, or the only store under ``FeatureData/``.

    ``note`` says which store was picked when ``cfg.visual_feature`` is None;
    none or several stores raise DataError listing them and naming ``key``
    (the config key, or the option of a command that takes it directly).
    """
    if cfg.visual_feature is not None:
        return cfg.visual_feature, None
    feature_dir = root / "FeatureData"
    found = feature_candidates(feature_dir)
    if len(found) == 1:
        return found[0], f"{key} not given: using the only feature store {feature_dir / found[0]}"
    if not found:
        raise DataError(f"no visual feature store (BigFile folder or .hdf5 file) in {feature_dir}; set {key}")
    raise DataError(f"several visual feature stores in {feature_dir}: {', '.join(found)}; set {key} to one")


def data_paths(cfg: "DataConfig") -> dict[str, Path]:
    """The file paths a DataConfig points to: root, visual, query, text_dir."""
    root = collection_root(cfg)
    visual = Path(visual_feature_of(cfg, root)[0]).expanduser()
    if not visual.is_absolute():
        visual = root / "FeatureData" / visual
    text_dir = root / "TextData"
    query = Path(cfg.text_feature or f"roberta_{cfg.collection}_query_feat.hdf5").expanduser()
    if not query.is_absolute():
        query = text_dir / query
    return {"root": root, "visual": visual, "query": query, "text_dir": text_dir}


def configured_splits(cfg: "DataConfig") -> list[str]:
    """The split names a DataConfig uses (train, val and test when set), without repeats."""
    names = [cfg.train_split, cfg.val_split, cfg.test_split]
    return list(dict.fromkeys(n for n in names if n))


def _shown(value) -> str:
    return str(list(value)) if isinstance(value, (list, tuple)) else str(value)


def check_synthetic_root(cfg: "DataConfig", root: Path, *, option: str | None = None) -> None:
    """Refuse a ``root`` whose synthetic collection is not the one ``cfg.synthesize`` / ``cfg.synth_seed`` asks for.

    Reads ``<root>/synth.json`` (written by :func:`prvrlab.data.synth.synthesize`); a root without it
    (a real dataset, or nothing yet) passes.  Raises DataError naming ``data.root`` (or ``option``, the
    command-line option that gave ``root`` for a saved model's config, e.g. ``eval --data-root``), the keys
    that differ with both values, and what to do.
    """
    from prvrlab.data.synth import SynthPreset, get_preset

    record = root / "synth.json"
    if not cfg.synthesize or not record.is_file():
        return
    key = option or "data.root"
    try:
        info = json.loads(record.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DataError(f"{record}: unreadable synthetic collection record ({exc}); give {key} another folder") from None
    if not isinstance(info, dict):
        raise DataError(f"{record}: not a synthetic collection record (a JSON object); give {key} another folder")
    wanted = get_preset(cfg.synthesize)
    settings = [f.name for f in dataclasses.fields(SynthPreset) if f.name != "name"]
    changed = [
        k for k in settings
        if k in info and (tuple(info[k]) if isinstance(info[k], list) else info[k]) != getattr(wanted, k)
    ]
    seed_differs = "seed" in info and info["seed"] != cfg.synth_seed
    if not changed and not seed_differs:
        return  # the same data (a preset alias such as 'skewed' / 'small-skewed' included)
    recorded_name, recorded_seed = info.get("name", "?"), info.get("seed", "?")
    differ = []
    if changed and recorded_name != cfg.synthesize:
        differ.append(f"data.synthesize={cfg.synthesize} (its synth.json: {recorded_name})")
    elif changed:  # same preset name, other settings: written by another version of the preset
        differ += [f"{k}={_shown(getattr(wanted, k))} (its synth.json: {_shown(info[k])})" for k in changed]
    if seed_differs:
        differ.append(f"data.synth_seed={cfg.synth_seed} (its synth.json: {recorded_seed})")
    if option is not None:  # a saved model's data: only the folder can change
        raise DataError(
            f"{option} {root}: holds another synthetic collection than the model was trained on: {', '.join(differ)}; "
            f"give {option} a folder of that collection, or write one with  prvrlab data synth --preset "
            f"{cfg.synthesize} --seed {cfg.synth_seed} --out <new folder>"
        )
    if changed and recorded_name == cfg.synthesize:
        todo = (f"give data.root another folder, or rewrite this one with  prvrlab data synth --preset "
                f"{cfg.synthesize} --seed {cfg.synth_seed} --out {root}")
    else:
        todo = (f"give data.root another folder for this collection, or set data.synthesize={recorded_name} "
                f"data.synth_seed={recorded_seed} to use the one there")
    raise DataError(
        f"data.root {cfg.root}: holds another synthetic collection than the config asks for: "
        f"{', '.join(differ)}; {todo}"
    )


def caption_collections(text_dir: Path) -> list[str]:
    """The collections ``text_dir`` holds a train, val or test caption file of, sorted."""
    names = set()
    for path in text_dir.glob("*.caption.txt") if text_dir.is_dir() else ():
        stem = path.name[: -len(".caption.txt")]
        names.update(stem[: -len(split)] for split in ("train", "val", "test") if stem.endswith(split) and len(stem) > len(split))
    return sorted(names)


def _check_feature_paths(cfg: "DataConfig", paths: dict[str, Path]) -> None:
    """A configured visual store or a query features file that is not there, named with what is: the stores
    under ``FeatureData/``, or the collections ``TextData/`` holds captions of (a misspelled collection)."""
    visual, feature_dir = paths["visual"], paths["root"] / "FeatureData"
    if not visual.exists() and visual.parent == feature_dir:
        stores = feature_candidates(feature_dir)
        listed = f"stores in {feature_dir.name}/: {', '.join(stores)}" if stores else f"no store in {feature_dir.name}/"
        raise DataError(f"visual features not found: {visual}{did_you_mean(visual.name, stores)}; {listed}")
    query = paths["query"]
    if not query.exists() and cfg.text_feature is None:
        known = caption_collections(paths["text_dir"])
        if known and cfg.collection not in known:
            raise DataError(f"query features file not found: {query}; {paths['text_dir']} holds captions of collection "
                            f"{', '.join(repr(k) for k in known)}, not {cfg.collection!r}{did_you_mean(cfg.collection, known)}")


def open_collection(cfg: "DataConfig", *, validate_splits: bool = True, allow_synthesize: bool = True) -> Collection:
    """Open the collection described by ``cfg``.

    When ``cfg.synthesize`` names a synthetic preset, ``cfg.root`` does not
    exist yet and ``allow_synthesize`` is true, the preset is generated there
    first (safe when several processes race to do it); a root that already
    holds a synthetic collection must hold that preset and seed
    (:func:`check_synthetic_root`).  With
    ``validate_splits`` the configured splits are indexed and checked now, so
    a bad file fails before training starts.
    """
    root = collection_root(cfg)
    if allow_synthesize and cfg.synthesize and not root.exists():
        from prvrlab.data.synth import synthesize_if_missing

        synthesize_if_missing(root, preset=cfg.synthesize, seed=cfg.synth_seed)
    if allow_synthesize and cfg.synthesize:
        check_synthetic_root(cfg, root)  # after the race above: whoever won wrote synth.json
    if not root.is_dir():
        raise DataError(f"data root not found: {root} (set data.root, or data.synthesize to generate one)")
    paths = data_paths(cfg)
    _check_feature_paths(cfg, paths)
    collection = Collection(
        name=cfg.collection,
        root=paths["root"],
        visual_path=paths["visual"],
        query_path=paths["query"],
        text_dir=paths["text_dir"],
        max_frames=cfg.max_frames,
        num_clips=cfg.num_clips,
        max_query_len=cfg.max_query_len,
        last_bin=cfg.last_bin,
        normalize=cfg.normalize,
    )
    collection.notes = [n for n in [visual_feature_of(cfg, root)[1]] if n]
    if validate_splits:
        for name in configured_splits(cfg):
            collection.split(name)
        collection.close()
    return collection
