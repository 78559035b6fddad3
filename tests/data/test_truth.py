"""Ground-truth relevance of synthetic collections."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from prvrlab.data.collection import open_collection
from prvrlab.data.config import DataConfig
from prvrlab.data.errors import DataError
from prvrlab.data.synth import GENERATOR_VERSION, refresh_if_outdated, synthesize
from prvrlab.data.truth import RelevanceTruth

from train_helpers import truly_relevant_by_hand

HAND = {
    "queries": {"q_pair": [0, 1], "q_object": [None, 1], "q_action": [2, None]},
    "videos": {"v0": [[0, 1]], "v1": [[2, 1]], "v2": [[0, 0], [2, 3]], "v3": [[1, 0]]},
}


def test_relevance_of_a_hand_built_truth():
    truth = RelevanceTruth(**HAND)
    queries, videos = ["q_pair", "q_object", "q_action"], ["v0", "v1", "v2", "v3"]
    expected = torch.tensor(
        [
            [True, False, False, False],  # (0, 1) is shown by v0 only
            [True, True, False, False],  # object 1 alone: v0 and v1
            [False, True, True, False],  # action 2 alone: v1 and v2
        ]
    )
    assert torch.equal(truth.relevant(queries, videos), expected)
    assert torch.equal(truth.relevant(["q_action"], ["v3", "v2"]), torch.tensor([[False, True]]))
    with pytest.raises(KeyError, match="'nope'"):
        truth.relevant(["nope"], videos)
    with pytest.raises(KeyError, match="'v9'"):
        truth.relevant(["q_pair"], ["v9"])


def test_synthetic_truth_matches_what_the_generator_wrote(tiny_root):
    collection = open_collection(DataConfig(root=str(tiny_root)))
    raw = json.loads((tiny_root / "TextData" / "synthtrain.truth.json").read_text())
    index = collection.split("train")
    relevant = collection.truth("train").relevant(index.query_ids, index.video_ids)  # (Nq, Nv)
    by_hand = torch.tensor([[truly_relevant_by_hand(raw, q, v) for v in index.video_ids] for q in index.query_ids])
    assert torch.equal(relevant, by_hand)
    own = relevant[torch.arange(len(index.query_ids)), torch.as_tensor(index.query_video)]
    assert bool(own.all())  # a query's own video always shows what it names
    assert int(relevant.sum()) > len(index.query_ids)  # shared concepts: some unpaired pairs are relevant


def test_real_collections_have_no_truth(tiny_root, tmp_path):
    copy = tmp_path / "copy"
    synthesize(copy, preset="tiny", seed=3, progress=False)
    for f in (copy / "TextData").glob("*.truth.json"):
        f.unlink()
    assert open_collection(DataConfig(root=str(copy))).truth("train") is None
    (copy / "TextData" / "synthval.truth.json").write_text("{not json")
    with pytest.raises(DataError, match="synthval.truth.json"):
        open_collection(DataConfig(root=str(copy))).truth("val")


def test_an_older_synthetic_collection_is_refreshed_with_identical_features(tmp_path):
    root = tmp_path / "old"
    synthesize(root, preset="tiny", seed=5, progress=False)
    features = (root / "FeatureData" / "synth_feat" / "feature.bin").read_bytes()
    captions = (root / "TextData" / "synthtrain.caption.txt").read_text()
    info = json.loads((root / "synth.json").read_text())
    for f in (root / "TextData").glob("*.truth.json"):
        f.unlink()
    (root / "synth.json").write_text(json.dumps({**info, "generator_version": 1}))

    assert refresh_if_outdated(root)
    assert (root / "FeatureData" / "synth_feat" / "feature.bin").read_bytes() == features
    assert (root / "TextData" / "synthtrain.caption.txt").read_text() == captions
    assert (root / "TextData" / "synthtrain.truth.json").is_file()
    assert json.loads((root / "synth.json").read_text())["generator_version"] == GENERATOR_VERSION
    assert not refresh_if_outdated(root)  # current: nothing to do


def test_a_refresh_never_writes_through_a_link_nor_regenerates_sizes_no_preset_has(tmp_path):
    """An outdated synth.json is a folder's word, not a preset: a link in the collection (to a folder
    elsewhere) is refused before anything is written or removed, and sizes no preset has are left alone."""
    root = tmp_path / "old"
    synthesize(root, preset="tiny", seed=5, progress=False)
    info = json.loads((root / "synth.json").read_text())
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("keep")
    shutil.rmtree(root / "FeatureData")
    (root / "FeatureData").symlink_to(outside, target_is_directory=True)
    (root / "synth.json").write_text(json.dumps({**info, "generator_version": 1}))
    with pytest.raises(DataError, match="symbolic link"):
        refresh_if_outdated(root)
    assert sorted(p.name for p in outside.iterdir()) == ["precious.txt"]

    huge = tmp_path / "huge"
    synthesize(huge, preset="tiny", seed=5, progress=False)
    before = {p: p.stat().st_mtime_ns for p in huge.rglob("*") if p.is_file()}
    big = {**json.loads((huge / "synth.json").read_text()), "generator_version": 1, "videos": [10**7, 1, 1]}
    (huge / "synth.json").write_text(json.dumps(big))
    assert not refresh_if_outdated(huge)
    assert {p: p.stat().st_mtime_ns for p in huge.rglob("*") if p.is_file() and p.name != "synth.json"} == {
        p: t for p, t in before.items() if p.name != "synth.json"
    }
