"""Reliability tests: the platform tests' helpers and a tiny synthetic collection."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> Path:
    from prvrlab.data.synth import synthesize

    root = tmp_path_factory.mktemp("synth_tiny")
    synthesize(root, preset="tiny", seed=0, progress=False)
    return root
