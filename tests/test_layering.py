"""Who may import whom: the data layer, evaluation and the reports import nothing from the platform."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "prvrlab"


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports (top level or inside functions)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


@pytest.mark.parametrize("room", ["data", "evaluation", "reports"])
def test_room_imports_nothing_from_the_platform(room):
    bad = {
        f"{path.relative_to(PACKAGE)}: {module}"
        for path in sorted((PACKAGE / room).rglob("*.py"))
        for module in imported_modules(path)
        if module == "prvrlab.platform" or module.startswith("prvrlab.platform.")
    }
    assert not bad
