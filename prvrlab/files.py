"""Files written whole or not at all (one definition for every writer)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path


def replace_atomically(target: str | Path, write: Callable[[Path], object]) -> Path:
    """Make ``target`` with ``write(tmp)``, which fills a fresh temporary file beside it, then renamed over
    ``target``: a reader never sees half a file and a crash leaves the old one (or none); a ``write`` that
    fails leaves no temporary behind.  Two writers racing leave one of the two whole files.  Returns
    ``target`` as a Path."""
    target = Path(target)
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.part")
    try:
        write(tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target
