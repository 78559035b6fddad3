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


def test_temporaries_a_killed_writer_left_are_removed_and_fresh_ones_kept(tmp_path):
    import os
    import time

    from prvrlab.files import STALE_PART_S

    target = tmp_path / "best_model.pt"
    stale = tmp_path / ".best_model.pt.0badc0de.part"  # left by a writer killed mid-write, long ago
    fresh = tmp_path / ".best_model.pt.f00dfeed.part"  # another writer's, still being written
    other = tmp_path / ".state.pt.0badc0de.part"  # another file's: not this writer's to judge
    for part in (stale, fresh, other):
        part.write_text("half")
    old = time.time() - STALE_PART_S - 60
    os.utime(stale, (old, old))
    os.utime(other, (old, old))
    replace_atomically(target, lambda tmp: tmp.write_text("whole"))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([target.name, fresh.name, other.name])


def test_a_text_file_written_for_later_reading_is_whole_or_the_old_one(tmp_path, monkeypatch):
    from pathlib import Path

    from prvrlab.files import write_text_atomically

    target = tmp_path / "config.yaml"
    write_text_atomically(target, "train:\n  lr: 0.0001\n  seed: 9527\n")
    real_write = Path.write_text

    def cut_off(self, text, *args, **kwargs):  # the disk fills half-way through
        real_write(self, text[: len(text) // 2], *args, **kwargs)
        raise OSError("No space left on device")

    monkeypatch.setattr(Path, "write_text", cut_off)
    with pytest.raises(OSError, match="No space left"):
        write_text_atomically(target, "train:\n  lr: 0.5\n  seed: 1\n  epochs: 3\n")
    monkeypatch.undo()
    assert target.read_text() == "train:\n  lr: 0.0001\n  seed: 9527\n"
    assert [p.name for p in tmp_path.iterdir()] == ["config.yaml"]
