"""Moment timestamps from the public datasets' annotation files (TVR jsonl, ActivityNet Captions json,
Charades-STA txt + Charades csv), matched to a caption file by video and sentence words."""

from __future__ import annotations

import json
import shutil

import pytest

from prvrlab.data.errors import DataError
from prvrlab.data.moments import FORMATS, match_moments, read_annotations, sentence_key
from prvrlab.data.text import read_captions, read_timestamps, timestamps_path
from prvrlab.platform.cli import EXIT_BAD_INPUT, build_parser, main


def test_sentence_key_keeps_only_lower_case_words():
    assert sentence_key("  A man, walking  his DOG. ") == "a man walking his dog"
    assert sentence_key("a man walking his dog") == sentence_key("A man walking his dog.")
    assert sentence_key("a man walks") != sentence_key("a man walking")


def test_tvr_records(tmp_path):
    path = tmp_path / "tvr_val_release.jsonl"
    rows = [{"vid_name": "castle_s01e01_seg02_clip_00", "desc": "Beckett opens the door.", "ts": [3.2, 9.0], "duration": 90.1,
             "desc_id": 7, "type": "v"},
            {"vid_name": "friends_s02e03_seg01_clip_11", "desc": "Ross sits down", "ts": [0, 4.5], "duration": 60}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert read_annotations(path, "tvr") == [
        ("castle_s01e01_seg02_clip_00", "Beckett opens the door.", (3.2, 9.0, 90.1)),
        ("friends_s02e03_seg01_clip_11", "Ross sits down", (0.0, 4.5, 60.0)),
    ]
    path.write_text(json.dumps({"vid_name": "v", "desc": "x", "ts": [1, 2]}) + "\n")
    with pytest.raises(DataError, match=r"tvr_val_release\.jsonl: line 1: expected a TVR record .*duration"):
        read_annotations(path, "tvr")


def test_activitynet_records(tmp_path):
    path = tmp_path / "val_1.json"
    path.write_text(json.dumps({"v_abc": {"duration": 120.5, "timestamps": [[0, 30.25], [40, 120.5]],
                                          "sentences": ["A boy runs.", " He falls."]}}))
    assert read_annotations(path, "activitynet") == [
        ("v_abc", "A boy runs.", (0.0, 30.25, 120.5)), ("v_abc", " He falls.", (40.0, 120.5, 120.5))
    ]
    path.write_text(json.dumps({"v_abc": {"duration": 1, "timestamps": [[0, 1]], "sentences": []}}))
    with pytest.raises(DataError, match="video 'v_abc': timestamps and sentences must be lists of one length"):
        read_annotations(path, "activitynet")


def test_charades_records_take_durations_from_the_csv(tmp_path):
    path = tmp_path / "charades_sta_test.txt"
    path.write_text("3MSZA 24.3 30.4##person turn a light on.\nAO8RW 0.0 6.9##a person is putting a book on a shelf.\n")
    lengths = tmp_path / "Charades_v1_test.csv"
    lengths.write_text("id,subject,length\n3MSZA,x,30.96\nAO8RW,y,33.67\n")
    assert read_annotations(path, "charades", durations=lengths) == [
        ("3MSZA", "person turn a light on.", (24.3, 30.4, 30.96)),
        ("AO8RW", "a person is putting a book on a shelf.", (0.0, 6.9, 33.67)),
    ]
    with pytest.raises(DataError, match="carry no video durations"):
        read_annotations(path, "charades")
    lengths.write_text("id,length\n3MSZA,30.96\n")
    with pytest.raises(DataError, match=r"line 2: video 'AO8RW' has no length in"):
        read_annotations(path, "charades", durations=lengths)
    path.write_text("3MSZA 24.3##no end\n")
    with pytest.raises(DataError, match=r"line 1: expected '<video> <start> <end>##<sentence>'"):
        read_annotations(path, "charades", durations=lengths)


def test_matching_by_video_and_words_with_repeats_in_order():
    captions = [("v1#enc#0", "a dog barks"), ("v1#enc#1", "A dog barks."), ("v2#enc#0", "a dog barks"),
                ("v2#enc#1", "nothing like it")]
    annotations = [("v1", "A dog barks", (0.0, 1.0, 10.0)), ("v2", "a dog barks!", (5.0, 6.0, 20.0)),
                   ("v1", "a dog  barks", (2.0, 3.0, 10.0))]
    got = match_moments(captions, annotations)
    assert got.moments == {"v1#enc#0": (0.0, 1.0, 10.0), "v1#enc#1": (2.0, 3.0, 10.0), "v2#enc#0": (5.0, 6.0, 20.0)}
    assert got.unmatched == ["v2#enc#1"]


def test_the_cli_round_trips_a_collections_own_moments(tiny_root, tmp_path, capsys):
    """The tiny collection's val moments written as a TVR file (sentences re-cased and punctuated) come back
    as the same timestamps file; the cli lists the formats this module reads."""
    root = tmp_path / "coll"
    shutil.copytree(tiny_root / "TextData", root / "TextData")
    truth_file = timestamps_path(root / "TextData", "synth", "val")
    truth = read_timestamps(truth_file)
    captions = read_captions(root / "TextData" / "synthval.caption.txt")
    records = [{"vid_name": c.split("#")[0], "desc": text.upper() + ".", "ts": list(truth[c][:2]), "duration": truth[c][2]}
               for c, text in captions[1:]]  # the first caption has no annotation
    annotations = tmp_path / "tvr_val_release.jsonl"
    annotations.write_text("\n".join(json.dumps(r) for r in records))
    truth_file.unlink()
    code = main(["data", "timestamps", str(annotations), "--format", "tvr", "--root", str(root), "--collection", "synth",
                 "--split", "val"])
    out = capsys.readouterr().out
    assert code == 0
    assert f"moments of {len(captions) - 1:,} of {len(captions):,} captions; 1 without one (e.g. {captions[0][0]})" in out
    assert read_timestamps(truth_file) == {c: truth[c] for c, _ in captions[1:]}
    fmt = next(a for a in build_parser()._subparsers._group_actions[0].choices["data"]._subparsers._group_actions[0]
               .choices["timestamps"]._actions if a.dest == "format")
    assert tuple(fmt.choices) == FORMATS


def test_the_cli_refuses_a_file_that_matches_nothing_and_writes_nothing(tiny_root, tmp_path, capsys):
    root = tmp_path / "coll"
    shutil.copytree(tiny_root / "TextData", root / "TextData")
    timestamps_path(root / "TextData", "synth", "test").unlink()
    annotations = tmp_path / "other.jsonl"
    annotations.write_text(json.dumps({"vid_name": "elsewhere", "desc": "x", "ts": [0, 1], "duration": 2}))
    code = main(["data", "timestamps", str(annotations), "--format", "tvr", "--root", str(root), "--collection", "synth",
                 "--split", "test"])
    err = capsys.readouterr().err
    assert code == EXIT_BAD_INPUT and err.count("\n") == 1 and "no caption of" in err and "check --format" in err
    assert not timestamps_path(root / "TextData", "synth", "test").exists()
    code = main(["data", "timestamps", str(annotations), "--format", "tvr", "--root", str(root), "--collection", "synth",
                 "--split", "tset"])
    assert code == EXIT_BAD_INPUT and "(did you mean 'test'?)" in capsys.readouterr().err


@pytest.mark.parametrize("ts, duration", [([9.0, 3.0], 20.0), ([-1.0, 3.0], 20.0), ([1.0, 3.0], 0.0)])
def test_a_record_that_is_no_moment_is_refused_naming_its_line(tmp_path, ts, duration):
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps({"vid_name": "v", "desc": "x", "ts": [0, 1], "duration": 5}) + "\n"
                    + json.dumps({"vid_name": "v", "desc": "y", "ts": ts, "duration": duration}))
    with pytest.raises(DataError, match=rf"a\.jsonl: line 2: not a moment: start {ts[0]:g}, end {ts[1]:g} in a video of {duration:g} s"):
        read_annotations(path, "tvr")


def test_an_annotation_folder_is_named_as_one(tmp_path):
    with pytest.raises(DataError, match=rf"^annotation file {tmp_path} is a folder: give the file in it$"):
        read_annotations(tmp_path, "activitynet")


def test_the_cli_counts_moments_that_end_after_their_video(tiny_root, tmp_path, capsys):
    root = tmp_path / "coll"
    shutil.copytree(tiny_root / "TextData", root / "TextData")
    captions = read_captions(root / "TextData" / "synthval.caption.txt")
    records = [{"vid_name": c.split("#")[0], "desc": text, "ts": [1.0, 12.0 if i < 2 else 4.0], "duration": 10.0}
               for i, (c, text) in enumerate(captions)]  # the first two end 2 s after their video
    annotations = tmp_path / "a.jsonl"
    annotations.write_text("\n".join(json.dumps(r) for r in records))
    assert main(["data", "timestamps", str(annotations), "--format", "tvr", "--root", str(root), "--collection", "synth",
                 "--split", "val"]) == 0
    assert "; 2 ending after their video's length (ratio taken as 1)" in capsys.readouterr().out
