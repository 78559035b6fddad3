"""Driver locks live in a folder of the user's own (0700), never in one another user could write or link."""

from __future__ import annotations

import os
import stat

from prvrlab.platform.tracking import drivers
from prvrlab.platform.tracking.drivers import driver_lock, driver_tags, lock_path, private_folder


def test_the_lock_is_in_the_users_private_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(drivers, "LOCK_DIR", tmp_path)
    tags = driver_tags()
    path = lock_path(tags)
    folder = tmp_path / f"prvrlab-locks-{os.getuid()}"
    assert path.parent == folder and path.name == f"prvrlab-driver-{os.getpid()}-{tags[drivers.START_TAG]}.lock"
    with driver_lock(tags) as got:
        assert got and path.exists()
    assert not path.exists()
    st = os.lstat(folder)
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()


def test_a_folder_others_can_write_is_not_used(tmp_path, monkeypatch):
    monkeypatch.setattr(drivers, "LOCK_DIR", tmp_path)
    tags = driver_tags()
    folder = lock_path(tags).parent
    folder.mkdir()
    folder.chmod(0o777)  # planted by someone else, or loosened: its locks could be held by anyone
    assert not private_folder(folder)
    with driver_lock(tags, wait_s=30.0) as got:  # not taken, and not waited for
        assert not got
    assert list(folder.iterdir()) == []


def test_a_link_in_place_of_the_folder_is_not_followed(tmp_path, monkeypatch):
    monkeypatch.setattr(drivers, "LOCK_DIR", tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    tags = driver_tags()
    lock_path(tags).parent.symlink_to(elsewhere)
    with driver_lock(tags) as got:
        assert not got
    assert list(elsewhere.iterdir()) == []


def test_a_link_in_place_of_the_lock_file_is_not_followed(tmp_path, monkeypatch):
    monkeypatch.setattr(drivers, "LOCK_DIR", tmp_path)
    tags = driver_tags()
    path = lock_path(tags)
    assert private_folder(path.parent)
    target = tmp_path / "victim"
    path.symlink_to(target)
    with driver_lock(tags, wait_s=0.0) as got:
        assert not got
    assert not target.exists()
