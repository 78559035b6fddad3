"""Moment timestamps for the moment/video-ratio breakdown, from the public datasets' own annotation files.

The feature releases (MS-SL's layout) ship captions without moments; the datasets' annotations have them:

- ``tvr``: TVR's ``tvr_<split>_release.jsonl``, one JSON object a line with ``vid_name``, ``desc``, ``ts``
  ([start, end] seconds) and ``duration``;
- ``activitynet``: ActivityNet Captions' ``train.json`` / ``val_1.json`` / ``val_2.json``,
  ``{video_id: {"duration", "timestamps": [[start, end], ...], "sentences": [...]}}``;
- ``charades``: Charades-STA's ``charades_sta_<split>.txt``, ``"<video> <start> <end>##<sentence>"`` a line,
  with the videos' durations from Charades' ``Charades_v1_<split>.csv`` (columns ``id`` and ``length``).

A caption is matched to an annotation by its video (``cap_id`` before the first ``#``) and its sentence,
compared as lower-case words (punctuation and spacing aside); the same sentence twice in one video takes
the annotations in file order. The result is :func:`prvrlab.data.text.write_timestamps`'s file.
"""

from __future__ import annotations

import csv
import json
import re
from collections import defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path

from prvrlab.data.errors import DataError
from prvrlab.data.text import checked_moment, checked_number, video_id_of

FORMATS = ("tvr", "activitynet", "charades")

Moment = tuple[float, float, float]  # (start, end, video duration) in seconds


def sentence_key(text: str) -> str:
    """A sentence as its lower-case words: 'A man, walking.' and 'a man walking' are the same key."""
    return " ".join(re.findall(r"[0-9a-z]+", text.lower()))


def _read_text(path: Path) -> str:
    if path.is_dir():
        raise DataError(f"annotation file {path} is a folder: give the file in it")
    if not path.is_file():
        raise DataError(f"annotation file not found: {path}")
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def _tvr(path: Path) -> list[tuple[str, str, Moment]]:
    out = []
    for number, line in enumerate(_read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            video, sentence, (start, end), duration = item["vid_name"], item["desc"], item["ts"], item["duration"]
        except (ValueError, KeyError, TypeError) as exc:
            raise DataError(f"{path}: line {number}: expected a TVR record with vid_name, desc, ts [start, end] "
                            f"and duration ({type(exc).__name__}: {exc})") from None
        out.append((str(video), str(sentence), checked_moment(start, end, duration, path, f"line {number}")))
    return out


def _activitynet(path: Path) -> list[tuple[str, str, Moment]]:
    try:
        raw = json.loads(_read_text(path))
    except ValueError as exc:
        raise DataError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise DataError(f"{path}: expected ActivityNet Captions' object {{video_id: {{duration, timestamps, sentences}}}}")
    out = []
    for video, item in raw.items():
        try:
            duration, stamps, sentences = item["duration"], item["timestamps"], item["sentences"]
        except (KeyError, TypeError):
            raise DataError(f"{path}: video {video!r}: expected duration, timestamps and sentences") from None
        if not (isinstance(stamps, list) and isinstance(sentences, list) and len(stamps) == len(sentences)):
            raise DataError(f"{path}: video {video!r}: timestamps and sentences must be lists of one length")
        d = checked_number(duration, path, f"video {video!r}")
        for k, (stamp, sentence) in enumerate(zip(stamps, sentences)):
            if not (isinstance(stamp, list) and len(stamp) == 2):
                raise DataError(f"{path}: video {video!r}: timestamp {k}: expected [start, end], got {stamp!r}")
            out.append((str(video), str(sentence), checked_moment(stamp[0], stamp[1], d, path, f"video {video!r} timestamp {k}")))
    return out


def _durations(path: Path) -> dict[str, float]:
    rows = csv.DictReader(_read_text(path).splitlines())
    if not rows.fieldnames or "id" not in rows.fieldnames or "length" not in rows.fieldnames:
        raise DataError(f"{path}: expected Charades' CSV with the columns id and length, got {rows.fieldnames}")
    return {row["id"]: checked_number(row["length"], path, f"video {row['id']!r} length") for row in rows}


def _charades(path: Path, durations: Path | None) -> list[tuple[str, str, Moment]]:
    if durations is None:
        raise DataError(f"{path}: Charades-STA's annotations carry no video durations; give Charades' "
                        "Charades_v1_<split>.csv (its id and length columns) with --durations")
    lengths = _durations(durations)
    out = []
    for number, line in enumerate(_read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        head, sep, sentence = line.partition("##")
        parts = head.split()
        if not sep or len(parts) != 3:
            raise DataError(f"{path}: line {number}: expected '<video> <start> <end>##<sentence>', got {line[:80]!r}")
        video = parts[0]
        if video not in lengths:
            raise DataError(f"{path}: line {number}: video {video!r} has no length in {durations}")
        out.append((video, sentence, checked_moment(parts[1], parts[2], lengths[video], path, f"line {number}")))
    return out


def read_annotations(path: str | Path, fmt: str, *, durations: str | Path | None = None) -> list[tuple[str, str, Moment]]:
    """``[(video_id, sentence, (start, end, duration)), ...]`` of one annotation file, in file order."""
    path = Path(path)
    if fmt == "tvr":
        return _tvr(path)
    if fmt == "activitynet":
        return _activitynet(path)
    if fmt == "charades":
        return _charades(path, Path(durations) if durations is not None else None)
    raise ValueError(f"unknown annotation format {fmt!r}; formats: {', '.join(FORMATS)}")


@dataclass
class Matched:
    """What :func:`match_moments` found: the moments by caption id and the captions left without one."""

    moments: dict[str, Moment] = field(default_factory=dict)
    unmatched: list[str] = field(default_factory=list)


def match_moments(captions: list[tuple[str, str]], annotations: list[tuple[str, str, Moment]]) -> Matched:
    """Each caption ``(cap_id, text)``'s moment: the annotation of its video with the same sentence key
    (:func:`sentence_key`); a sentence repeated in a video takes its annotations in order."""
    pool: dict[tuple[str, str], deque[Moment]] = defaultdict(deque)
    for video, sentence, moment in annotations:
        pool[video, sentence_key(sentence)].append(moment)
    out = Matched()
    for cap_id, text in captions:
        found = pool.get((video_id_of(cap_id), sentence_key(text)))
        if found:
            out.moments[cap_id] = found.popleft()
        else:
            out.unmatched.append(cap_id)
    return out
