"""prvrlab's per-user cache folder: ``$PRVRLAB_CACHE_DIR``, else ``~/.cache/prvrlab``."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """The cache folder (not created here); each user of it keeps to its own subfolder."""
    return Path(os.environ.get("PRVRLAB_CACHE_DIR") or Path.home() / ".cache" / "prvrlab")
