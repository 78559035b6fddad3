"""A timestamps file whose entry is not a moment (end before start, no duration, NaN, a negative start) is one
error naming the file and the query when read alone, by the check `data timestamps` applies; a collection
leaves such entries out of the ratio groups and says so in a note (they had been grouped silently, or not at
all). Booleans are no numbers. An end past the video's length stays allowed (counted long)."""

from __future__ import annotations

import json

import pytest

from prvrlab.data.errors import DataError
from prvrlab.data.text import read_timestamps


@pytest.mark.parametrize("entry, why", [
    ([50, 10, 100], "not a moment: start 50, end 10 in a video of 100 s"),
    ([1, 2, 0], "not a moment: start 1, end 2 in a video of 0 s"),
    ([-5, -1, -10], "not a moment"),
    ([1.0, 2.0, float("nan")], "expected a finite number, got nan"),
    ([True, False, True], "expected [start, end, duration], got [True, False, True]"),
])
def test_an_entry_that_is_not_a_moment_is_refused_naming_the_file_and_query(tmp_path, entry, why):
    path = tmp_path / "synthval.timestamps.json"
    path.write_text(json.dumps({"v1#0": [0.0, 1.0, 10.0], "v1#1": entry}))
    with pytest.raises(DataError) as caught:
        read_timestamps(path)
    assert str(caught.value).startswith(f"{path}: query 'v1#1': ") and why in str(caught.value)


def test_moments_that_touch_the_ends_or_overrun_the_video_are_kept(tmp_path):
    path = tmp_path / "t.json"
    stamps = {"a": [0, 0, 5], "b": [0, 5, 5], "c": [4, 7.5, 5], "d": [1, 2, 3]}
    path.write_text(json.dumps(stamps))
    assert read_timestamps(path) == {k: tuple(float(x) for x in v) for k, v in stamps.items()}


def test_a_collection_leaves_such_entries_out_of_the_ratio_groups_with_a_note(tiny_root, tmp_path):
    import shutil

    import numpy as np

    from prvrlab.data.collection import open_collection
    from prvrlab.data.config import DataConfig

    root = tmp_path / "copy"
    shutil.copytree(tiny_root, root)
    path = root / "TextData" / "synthval.timestamps.json"
    stamps = json.loads(path.read_text())
    first, second = sorted(stamps)[:2]
    stamps[first] = [5.0, 1.0, 10.0]
    stamps[second] = [0.0, 1.0, 0.0]
    path.write_text(json.dumps(stamps))
    collection = open_collection(DataConfig(root=str(root), collection="synth", visual_feature="synth_feat"))
    index = collection.split("val")
    ratios = dict(zip(index.query_ids, index.ratios))
    assert np.isnan(ratios[first]) and np.isnan(ratios[second])
    assert sum(not np.isnan(r) for r in index.ratios) == len(stamps) - 2
    (note,) = [n for n in collection.notes if "timestamps" in n]
    assert note == (f"{path}: 2 entries are no moment, left out of the ratio groups "
                    f"(first: query {first!r}: not a moment: start 5, end 1 in a video of 10 s)")
