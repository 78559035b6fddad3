"""prvrlab.files.replace_atomically: a file written whole or not at all."""

from __future__ import annotations

import threading

import pytest

from prvrlab.files import replace_atomically


def test_the_target_appears_only_once_written_and_a_failed_write_keeps_the_old_one(tmp_path):
    target = tmp_path / "ranks.parquet"
    seen_during_write = []

    def write(tmp):
        tmp.write_text("first")
        seen_during_write.append((target.exists(), tmp.parent == target.parent, tmp.name.endswith(".part")))

    assert replace_atomically(target, write) == target
    assert target.read_text() == "first" and seen_during_write == [(False, True, True)]

    def fails(tmp):
        tmp.write_text("half")
        raise ValueError("stopped")

    with pytest.raises(ValueError, match="stopped"):
        replace_atomically(str(target), fails)
    assert target.read_text() == "first" and [p.name for p in tmp_path.iterdir()] == ["ranks.parquet"]


def test_racing_writers_leave_one_whole_file(tmp_path):
    target = tmp_path / "state.json"
    texts = [str(i) * 100_000 for i in range(8)]
    threads = [threading.Thread(target=replace_atomically, args=(target, lambda tmp, t=t: tmp.write_text(t))) for t in texts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert target.read_text() in texts and [p.name for p in tmp_path.iterdir()] == ["state.json"]
