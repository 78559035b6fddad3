"""Shared fixtures: a tiny synthetic collection and a small, fast config."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# train_helpers / search_helpers live here; tests in the sub-folders (train/, search/, ...) import them.
sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> Path:
    from prvrlab.data.synth import synthesize

    root = tmp_path_factory.mktemp("synth_tiny")
    synthesize(root, preset="tiny", seed=0, progress=False)
    return root
