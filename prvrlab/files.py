"""Files written whole or not at all (one definition for every writer)."""

from __future__ import annotations

import os
import stat
import time
import uuid
from collections.abc import Callable
from pathlib import Path

STALE_PART_S = 6 * 3600.0  # a temporary untouched this long was left by a writer that died


_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def special_kind(path: str | Path) -> str | None:
    """What ``path`` is when it exists and is not a regular file (``"a character device"``, ...); else None.
    Links are followed."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def replace_atomically(target: str | Path, write: Callable[[Path], object]) -> Path:
    """Make ``target`` with ``write(tmp)``, which fills a fresh temporary file beside it, then renamed over
    ``target``: a reader never sees half a file and a process that dies leaves the old one (or none); a
    ``write`` that fails leaves no temporary behind.  Two writers racing leave one of the two whole files.
    Temporaries of ``target`` that a killed writer left (untouched for :data:`STALE_PART_S`) are removed
    once the new file is in place.  Returns ``target`` as a Path."""
    target = Path(target)
    kind = special_kind(target)
    if kind is not None:  # a rename would replace a device, FIFO or socket with a file (/dev/full, run as root)
        raise FileExistsError(f"{target}: is {kind}, not replaced with a file")
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.part")
    try:
        write(tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    _remove_stale(target)
    return target


def write_text_atomically(target: str | Path, text: str) -> Path:
    """Write ``text`` to ``target`` whole or not at all (:func:`replace_atomically`)."""
    return replace_atomically(target, lambda tmp: tmp.write_text(text))


def leading_comments(path: str | Path) -> list[str]:
    """The comment lines (``#`` ...) at the top of a text file such as a YAML config or spec, as written."""
    lines = []
    for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.startswith("#"):
            break
        lines.append(line)
    return lines


def leaves_folder(rel: str) -> bool:
    """Whether the relative path ``rel`` (``/``-separated, e.g. an object-store key or an artifact path from a
    server) could leave the folder it is joined to: empty, absolute, or with an empty, ``.`` or ``..`` part."""
    return not rel or rel.startswith("/") or any(part in ("", ".", "..") for part in rel.split("/"))


def _remove_stale(target: Path) -> None:
    """Remove the temporaries of ``target`` older than :data:`STALE_PART_S` (another writer's fresh one stays)."""
    cutoff = time.time() - STALE_PART_S
    for part in target.parent.glob(f".{target.name}.*.part"):
        try:
            if part.stat().st_mtime < cutoff:
                part.unlink()
        except FileNotFoundError:  # its writer finished or another cleaner came first
            pass
