"""Ground-truth relevance of a synthetic collection (diagnostics only).

The synthetic generator (:mod:`prvrlab.data.synth`) knows what every moment
shows, an (action, object) concept, and what every query names (both, or only
one of the two for a vague query).  It writes, per split,
``TextData/<collection><split>.truth.json``::

    {"queries": {cap_id: [action | null, object | null]},
     "videos":  {video_id: [[action, object], ...]}}

A video is *truly relevant* to a query when one of its moments shows
everything the query names.  The query's own video always is; other videos
that show the same concept are the "unpaired but relevant" pairs that methods
such as ARL (ambiguous pairs) or ICE (pseudo-positives) try to find.  No public
dataset has such a file: components use :class:`RelevanceTruth` only to log how
well they find those pairs, never to train.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from prvrlab.data.errors import DataError

_ANY = -1  # a concept part the query does not name
MAX_TABLE_CELLS = 1 << 28  # videos x concept columns a truth file may need (the tvr preset's train split: 7.4e7)


def truth_file_name(collection: str, split: str) -> str:
    """File name of a split's ground truth, beside its caption file."""
    return f"{collection}{split}.truth.json"


class RelevanceTruth:
    """Which videos truly show what each query describes."""

    def __init__(self, *, queries: dict[str, Sequence[int | None]], videos: dict[str, Sequence[Sequence[int]]]) -> None:
        self._query = {q: (_ANY if a is None else int(a), _ANY if o is None else int(o)) for q, (a, o) in queries.items()}
        self._video_row = {v: i for i, v in enumerate(videos)}
        pairs = [(int(a), int(o)) for shown in videos.values() for a, o in shown]
        self.num_actions = 1 + max((a for a, _ in pairs), default=-1)
        self.num_objects = 1 + max((o for _, o in pairs), default=-1)
        a_count, o_count = self.num_actions, self.num_objects
        # One row per video, one column per concept a query can name: (a, o) pairs,
        # then an action alone, then an object alone.
        shows = np.zeros((len(videos), a_count * o_count + a_count + o_count), dtype=bool)  # (Nv, C)
        for row, shown in enumerate(videos.values()):
            for a, o in shown:
                shows[row, [a * o_count + o, a_count * o_count + a, a_count * o_count + a_count + o]] = True
        self._shows = shows

    @classmethod
    def load(cls, path: str | Path) -> "RelevanceTruth":
        """Read a ``*.truth.json`` file; DataError naming the file when it is malformed, an id is negative or
        out of range, or its concept ids would need a table of more than :data:`MAX_TABLE_CELLS` cells."""
        path = Path(path)
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            queries, videos = raw["queries"], raw["videos"]
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as err:
            raise DataError(f"{path}: not a ground-truth file ({type(err).__name__}: {err})") from err
        _check(path, queries=queries, videos=videos)
        return cls(queries=queries, videos=videos)

    def _column(self, query_id: str) -> int:
        try:
            a, o = self._query[query_id]
        except KeyError:
            raise KeyError(f"query {query_id!r} is not in the ground truth") from None
        a_count, o_count = self.num_actions, self.num_objects
        if a == _ANY and o == _ANY:
            raise ValueError(f"query {query_id!r} names nothing")
        if o == _ANY:
            return a_count * o_count + a
        if a == _ANY:
            return a_count * o_count + a_count + o
        return a * o_count + o

    def relevant(self, query_ids: Sequence[str], video_ids: Sequence[str]) -> torch.Tensor:
        """Bool ``(Nq, Nv)``: True where the video shows what the query names."""
        cols = np.fromiter((self._column(q) for q in query_ids), dtype=np.int64, count=len(query_ids))  # (Nq,)
        try:
            rows = np.fromiter((self._video_row[v] for v in video_ids), dtype=np.int64, count=len(video_ids))  # (Nv,)
        except KeyError as err:
            raise KeyError(f"video {err.args[0]!r} is not in the ground truth") from None
        return torch.from_numpy(np.ascontiguousarray(self._shows[np.ix_(rows, cols)].T))  # (Nq, Nv)


def _is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_pair(value: object) -> bool:
    return isinstance(value, list) and len(value) == 2 and all(map(_is_id, value))


def _check(path: Path, *, queries: object, videos: object) -> None:
    """DataError naming ``path`` (and the id) unless ``queries`` / ``videos`` are what :class:`RelevanceTruth` reads."""
    if not (isinstance(queries, dict) and isinstance(videos, dict)):
        raise DataError(f"{path}: not a ground-truth file ('queries' and 'videos' must be JSON objects)")
    actions = objects = 0
    for vid, shown in videos.items():
        if not (isinstance(shown, list) and all(map(_is_pair, shown))):
            raise DataError(f"{path}: video {vid!r}: expected [[action, object], ...] of ids >= 0, got {shown!r:.80}")
        for a, o in shown:
            actions, objects = max(actions, a + 1), max(objects, o + 1)
    cells = len(videos) * (actions * objects + actions + objects)
    if cells > MAX_TABLE_CELLS:
        raise DataError(
            f"{path}: concept ids up to action {actions - 1}, object {objects - 1} for {len(videos)} videos need "
            f"{cells} table cells (at most {MAX_TABLE_CELLS}): ids must count from 0"
        )
    for qid, named in queries.items():
        ok = isinstance(named, list) and len(named) == 2 and named != [None, None]
        if not ok or not all(v is None or (_is_id(v) and v < top) for v, top in zip(named, (actions, objects))):
            raise DataError(
                f"{path}: query {qid!r}: expected [action | null, object | null] naming concepts that some video "
                f"shows (actions < {actions}, objects < {objects}), got {named!r:.80}"
            )
