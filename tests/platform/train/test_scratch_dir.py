"""Checkpoint scratch folders: removed after use, and those of killed processes removed later."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

from prvrlab.platform.train import session


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _folder(parent, name, age_s):
    path = parent / name
    path.mkdir()
    (path / "state.pt").write_bytes(b"x")
    old = time.time() - age_s
    os.utime(path, (old, old))
    return path


def test_stale_folders_of_ended_processes_are_removed(tmp_path):
    dead, live = _dead_pid(), os.getpid()
    day = 24 * 3600
    stale = _folder(tmp_path, f"prvrlab-ckpt-{dead}-abc", day)
    recent = _folder(tmp_path, f"prvrlab-ckpt-{dead}-def", 60)  # maybe another namespace's live process
    running = _folder(tmp_path, f"prvrlab-ckpt-{live}-ghi", day)
    unnamed = _folder(tmp_path, "prvrlab-ckpt-xyz", day)  # before pid-named folders: not ours to judge
    other = _folder(tmp_path, f"other-{dead}-abc", day)
    assert session.remove_stale_scratch(tmp_path) == [stale]
    assert not stale.exists()
    assert all(p.is_dir() for p in (recent, running, unnamed, other))
    assert session.remove_stale_scratch(tmp_path, min_age_s=0) == [recent]


def test_scratch_dir_is_pid_named_removed_after_use_and_sweeps_once(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    session._sweep_once.cache_clear()
    try:
        stale = _folder(tmp_path, f"prvrlab-ckpt-{_dead_pid()}-abc", session.STALE_SCRATCH_S + 60)
        with session.scratch_dir() as path:
            assert path.parent == tmp_path and path.name.startswith(f"prvrlab-ckpt-{os.getpid()}-")
            assert not stale.exists()
        assert not path.exists()
        again = _folder(tmp_path, f"prvrlab-ckpt-{_dead_pid()}-def", session.STALE_SCRATCH_S + 60)
        with session.scratch_dir():
            pass
        assert again.exists()  # swept once per process and folder
    finally:
        session._sweep_once.cache_clear()  # the real temp dir is swept again by the next scratch_dir
