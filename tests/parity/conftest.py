"""Everything in tests/parity/ belongs to the parity suite (``pytest -m parity`` runs it with the
parity-marked worked examples that live beside the modules they test)."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.parity)
