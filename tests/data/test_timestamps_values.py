"""A timestamps file whose entry is not a moment (end before start, no duration, NaN, booleans, a negative start)
is one error naming the file and the query, as `data timestamps` refuses such records; it had been read and the
run's ratio groups came out empty without a word. An end past the video's length stays allowed (counted long)."""

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
