"""The synthetic generator: layout, readability, determinism, structure."""

from __future__ import annotations

import dataclasses
import multiprocessing
import time

import h5py
import numpy as np
import pytest

from prvrlab.data.bigfile import BigFile
from prvrlab.data.collection import open_collection
from prvrlab.data.errors import DataError
from prvrlab.data.inspect import inspect_collection
from prvrlab.data.synth import PRESETS, get_preset, synthesize
from prvrlab.data.text import read_captions
from prvrlab.data.config import DataConfig


def test_layout(tiny_root):
    feat = tiny_root / "FeatureData" / "synth_feat"
    for name in ("feature.bin", "shape.txt", "id.txt", "video2frames.txt"):
        assert (feat / name).is_file()
    text = tiny_root / "TextData"
    assert (text / "roberta_synth_query_feat.hdf5").is_file()
    for split in ("train", "val", "test"):
        assert (text / f"synth{split}.caption.txt").is_file()
        assert (text / f"synth{split}.timestamps.json").is_file()
    n, d = map(int, (feat / "shape.txt").read_text().split())
    assert d == 64 and (feat / "feature.bin").stat().st_size == n * d * 4


def test_reads_back_through_open_collection(tiny_root):
    col = open_collection(DataConfig(root=str(tiny_root)))
    assert (col.video_dim, col.query_dim) == (64, 48)
    sizes = {s: col.split(s).num_videos for s in ("train", "val", "test")}
    assert tuple(sizes.values()) == PRESETS["tiny"].videos
    ids = [v for s in ("train", "val", "test") for v in col.split(s).video_ids]
    assert len(ids) == len(set(ids)) == len(col.visual)  # unique across splits
    train = col.split("train")
    assert 8 <= train.frame_counts.min() and train.frame_counts.max() <= 60
    assert set(np.diff(train.query_offsets).tolist()) <= {2, 3}
    # one caption word per token
    texts = dict(read_captions(col.caption_file("train")))
    for q in train.query_ids[:20]:
        assert len(texts[q].split()) == len(col.queries.tokens(q))


def test_ratio_groups_present(tiny_root):
    col = open_collection(DataConfig(root=str(tiny_root)))
    r = np.concatenate([col.split(s).ratios for s in ("train", "val", "test")])
    assert np.isfinite(r).all() and (r > 0).all() and (r <= 1).all()
    assert (r <= 0.2).any() and ((r > 0.2) & (r <= 0.4)).any() and (r > 0.4).any()
    report = inspect_collection(DataConfig(root=str(tiny_root)))
    assert all(min(s.ratio_groups.values()) > 0 for s in report.splits)


def test_deterministic_and_seed_dependent(tmp_path):
    a = synthesize(tmp_path / "a", preset="tiny", seed=7, progress=False)
    b = synthesize(tmp_path / "b", preset="tiny", seed=7, progress=False)
    c = synthesize(tmp_path / "c", preset="tiny", seed=8, progress=False)
    rel = "FeatureData/synth_feat/feature.bin"
    assert (a / rel).read_bytes() == (b / rel).read_bytes()
    assert (a / rel).read_bytes() != (c / rel).read_bytes()
    for rel in ("TextData/synthtrain.caption.txt", "TextData/synthval.timestamps.json", "FeatureData/synth_feat/video2frames.txt"):
        assert (a / rel).read_text() == (b / rel).read_text()
    with h5py.File(a / "TextData/roberta_synth_query_feat.hdf5") as fa, h5py.File(b / "TextData/roberta_synth_query_feat.hdf5") as fb:
        assert list(fa) == list(fb)
        for key in list(fa)[:30]:
            np.testing.assert_array_equal(fa[key][()], fb[key][()])


def test_tiny_is_fast(tmp_path):
    start = time.perf_counter()
    synthesize(tmp_path / "t", preset="tiny", progress=False)
    assert time.perf_counter() - start < 3.0  # ~0.1 s alone; generous on a shared 2-core machine


def test_overwrites_previous_synthetic_files_only(tmp_path):
    root = synthesize(tmp_path / "r", preset="tiny", seed=0, progress=False)
    (root / "TextData" / "notes.txt").write_text("keep me")
    synthesize(root, preset="tiny", seed=1, progress=False)
    assert (root / "TextData" / "notes.txt").read_text() == "keep me"
    fresh = synthesize(tmp_path / "fresh", preset="tiny", seed=1, progress=False)
    rel = "FeatureData/synth_feat/feature.bin"
    assert (root / rel).read_bytes() == (fresh / rel).read_bytes()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left


def test_open_collection_synthesizes_missing_root(tmp_path):
    cfg = DataConfig(root=str(tmp_path / "auto"), synthesize="tiny", synth_seed=3)
    col = open_collection(cfg)
    assert col.split("val").num_videos == PRESETS["tiny"].videos[1]
    assert (tmp_path / "auto" / "synth.json").is_file()


def test_video_features_are_not_aligned_with_text(tiny_root):
    # Visual features live in a different random space: no raw dimension match, non-trivial values.
    bf = BigFile(tiny_root / "FeatureData" / "synth_feat")
    x = bf.frames(bf.video_ids()[0])
    assert x.shape[1] == 64 and np.abs(x).mean() > 0.01 and x.std(axis=0).mean() > 0.01


def test_skewed_variant_has_common_offset(tmp_path):
    plain = open_collection(DataConfig(root=str(synthesize(tmp_path / "p", preset="tiny", progress=False))))
    skewed = open_collection(
        DataConfig(root=str(synthesize(tmp_path / "s", preset="tiny-skewed", progress=False)))
    )

    def mean_cos(col):
        toks = np.concatenate([col.queries.tokens(q) for q in col.split("train").query_ids[:40]])
        toks /= np.linalg.norm(toks, axis=1, keepdims=True)
        centre = toks.mean(0)
        return float(np.linalg.norm(centre))  # ~1 when every token points the same way

    assert mean_cos(skewed) > 0.8 > 0.5 > mean_cos(plain)
    assert skewed.split("train").token_counts.mean() > plain.split("train").token_counts.mean()


def test_presets():
    tvr = PRESETS["tvr"]
    assert tvr.videos == (17435, 2179, 2179) and tvr.queries_per_video == (5, 5)
    assert tvr.videos[0] * 5 == 87175 and tvr.videos[1] * 5 == 10895
    assert (tvr.video_dim, tvr.query_dim) == (3072, 768)
    small = PRESETS["small"]
    assert small.videos == (600, 150, 150) and (small.video_dim, small.query_dim) == (256, 128)
    assert small.frames[1] > 128  # exercises frame mean-pooling
    assert PRESETS["skewed"].skewed and not small.skewed
    assert get_preset("medium-skewed") == dataclasses.replace(PRESETS["medium"], name="medium-skewed", skewed=True)
    with pytest.raises(DataError, match="unknown synthetic preset 'huge'"):
        get_preset("huge")
    with pytest.raises(dataclasses.FrozenInstanceError):
        small.video_dim = 3


def _race(root):
    from prvrlab.data.synth import synthesize_if_missing

    synthesize_if_missing(root, preset="tiny", seed=2)


def test_concurrent_synthesize_if_missing(tmp_path):
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_race, args=(tmp_path / "race",)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    ref = synthesize(tmp_path / "ref", preset="tiny", seed=2, progress=False)
    rel = "FeatureData/synth_feat/feature.bin"
    assert (tmp_path / "race" / rel).read_bytes() == (ref / rel).read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["race", "ref"]
