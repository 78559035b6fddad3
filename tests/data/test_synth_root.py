"""data.synthesize on a root that already holds a synthetic collection: the one synth.json records must be
the one the config asks for (else the run would train on other data than it records)."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from prvrlab.data.collection import open_collection
from prvrlab.data.config import DataConfig
from prvrlab.data.errors import DataError
from prvrlab.data.synth import PRESETS


def refusal(root, asked: str, differ: str, recorded: dict) -> str:
    return (
        f"data.root {root}: holds another synthetic collection than the config asks for: {differ}; "
        + asked.format(**recorded)
    )


USE_THERE = "give data.root another folder for this collection, or set data.synthesize={name} data.synth_seed={seed} to use the one there"


@pytest.mark.parametrize(
    "preset, seed, differ",
    [
        ("small", 3, "data.synthesize=small (its synth.json: tiny), data.synth_seed=3 (its synth.json: 0)"),
        ("small", 0, "data.synthesize=small (its synth.json: tiny)"),
        ("tiny", 3, "data.synth_seed=3 (its synth.json: 0)"),
        ("tiny-skewed", 0, "data.synthesize=tiny-skewed (its synth.json: tiny)"),
    ],
)
def test_a_root_holding_another_synthetic_collection_is_refused(tiny_root, preset, seed, differ):
    recorded = json.loads((tiny_root / "synth.json").read_text())
    assert (recorded["name"], recorded["seed"]) == ("tiny", 0)
    before = sorted(p.relative_to(tiny_root) for p in tiny_root.rglob("*"))
    cfg = DataConfig(root=str(tiny_root), synthesize=preset, synth_seed=seed)
    with pytest.raises(DataError) as info:
        open_collection(cfg)
    assert str(info.value) == refusal(tiny_root, USE_THERE, differ, recorded)
    assert sorted(p.relative_to(tiny_root) for p in tiny_root.rglob("*")) == before  # nothing rewritten


def test_the_matching_collection_and_a_real_dataset_open(tiny_root, tmp_path):
    col = open_collection(DataConfig(root=str(tiny_root), synthesize="tiny", synth_seed=0))
    assert col.split("val").num_videos == PRESETS["tiny"].videos[1]
    real = tmp_path / "real"
    shutil.copytree(tiny_root, real)
    (real / "synth.json").unlink()  # not written by the generator: never compared
    col = open_collection(DataConfig(root=str(real), synthesize="small", synth_seed=3))
    assert col.split("val").num_videos == PRESETS["tiny"].videos[1]
    assert not (real / "synth.json").exists()


def test_a_root_written_by_another_version_of_the_preset_is_refused(tiny_root, tmp_path):
    root = tmp_path / "old"
    shutil.copytree(tiny_root, root)
    info = json.loads((root / "synth.json").read_text())
    info.update(video_dim=32, frames=[8, 30])
    (root / "synth.json").write_text(json.dumps(info))
    with pytest.raises(DataError) as caught:
        open_collection(DataConfig(root=str(root), synthesize="tiny", synth_seed=0))
    tiny = PRESETS["tiny"]
    assert str(caught.value) == (
        f"data.root {root}: holds another synthetic collection than the config asks for: "
        f"frames={list(tiny.frames)} (its synth.json: [8, 30]), video_dim={tiny.video_dim} (its synth.json: 32); "
        f"give data.root another folder, or rewrite this one with  prvrlab data synth --preset tiny --seed 0 --out {root}"
    )


def test_a_nested_collection_is_checked_too(tiny_root, tmp_path):
    shutil.copytree(tiny_root, tmp_path / "synth")  # release layout: <data.root>/<collection>/
    with pytest.raises(DataError, match=r"data.synth_seed=1 \(its synth.json: 0\)"):
        open_collection(DataConfig(root=str(tmp_path), synthesize="tiny", synth_seed=1))
    assert open_collection(DataConfig(root=str(tmp_path), synthesize="tiny")).root == tmp_path / "synth"


def test_a_collection_generated_here_is_checked_after_a_racing_writer(tmp_path, monkeypatch):
    """Another process (another config) wins the race to write the root: its collection is not used silently."""
    import prvrlab.data.synth as synth

    def other_writer(root, *, preset, seed, progress=False):
        return synth.synthesize(root, preset="tiny", seed=seed + 1, progress=False)

    monkeypatch.setattr(synth, "synthesize_if_missing", other_writer)
    with pytest.raises(DataError, match=r"data.synth_seed=2 \(its synth.json: 3\)"):
        open_collection(DataConfig(root=str(tmp_path / "auto"), synthesize="tiny", synth_seed=2))


def test_tools_that_never_write_the_root_do_not_refuse_it(tiny_root):
    col = open_collection(DataConfig(root=str(tiny_root), synthesize="small", synth_seed=3), allow_synthesize=False,
                          validate_splits=False)
    assert col.video_dim == PRESETS["tiny"].video_dim


def test_an_unreadable_record_is_named(tiny_root, tmp_path):
    root = tmp_path / "bad"
    shutil.copytree(tiny_root, root)
    (root / "synth.json").write_text("{not json")
    with pytest.raises(DataError, match="^" + re.escape(f"{root / 'synth.json'}: unreadable synthetic collection record")):
        open_collection(DataConfig(root=str(root), synthesize="tiny"))
