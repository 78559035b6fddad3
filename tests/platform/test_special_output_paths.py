"""An output path that is a device, FIFO or socket is refused, never replaced with a file: `eval --ranks
/dev/full` had turned the container's /dev/full into a regular file (the atomic rename replaces any path)."""

from __future__ import annotations

import os
import stat

import pytest

from prvrlab.files import replace_atomically, special_kind
from prvrlab.platform import storage
from prvrlab.platform.cli import EXIT_BAD_INPUT, main
from prvrlab.platform.config import ConfigError


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "pipe"
    os.mkfifo(path)
    return path


def test_compare_out_and_eval_ranks_refuse_a_fifo_and_leave_it(fifo, capsys):
    assert main(["compare", "a" * 32, "b" * 32, "--out", str(fifo)]) == EXIT_BAD_INPUT
    assert capsys.readouterr().err.strip() == f"prvrlab: error: --out {fifo}: is a FIFO (named pipe); give a regular file's name"
    with pytest.raises(ConfigError, match=f"^--ranks {fifo}: is a FIFO"):  # what eval checks --ranks with
        storage.check_file(str(fifo), "--ranks")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_the_atomic_writer_never_renames_over_a_special_file(fifo):
    with pytest.raises(FileExistsError, match="is a FIFO"):
        replace_atomically(fifo, lambda tmp: tmp.write_text("x"))
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert sorted(p.name for p in fifo.parent.iterdir()) == ["pipe"]  # no temporary left


@pytest.mark.skipif(os.geteuid() != 0, reason="making a device node needs root")
def test_a_character_device_is_named_as_one(tmp_path):
    node = tmp_path / "full"
    os.mknod(node, 0o600 | stat.S_IFCHR, os.makedev(1, 7))
    assert special_kind(node) == "a character device"
    with pytest.raises(FileExistsError):
        replace_atomically(node, lambda tmp: tmp.write_text("x"))
    assert stat.S_ISCHR(os.stat(node).st_mode)


def test_a_regular_file_or_nothing_is_not_special(tmp_path):
    (tmp_path / "f").write_text("x")
    assert special_kind(tmp_path / "f") is None and special_kind(tmp_path / "none") is None
    assert special_kind(tmp_path) == "a folder"
