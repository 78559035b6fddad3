"""No import cycle through imports inside functions either: a deferred import hides a cycle from
Python's start-up but still ties the two modules together (a leaf module breaks it instead)."""

from __future__ import annotations

import ast
from pathlib import Path

from test_layering import PACKAGE, find_cycle, module_name


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """The nodes under ``if TYPE_CHECKING:`` (imports for annotations only, never run)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out.update(id(sub) for sub in ast.walk(node))
    return out


def all_imports(path: Path, known: set[str]) -> set[str]:
    """Package modules a file imports anywhere (module level or inside functions), resolved to modules."""
    tree = ast.parse(path.read_text())
    skipped = _type_checking_nodes(tree)
    out = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        out.update(n for n in names if n in known)
    return out


def test_all_imports_sees_deferred_imports_and_skips_type_checking(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\n"
                      "def f():\n    from b import c\n    import d\n")
    assert all_imports(source, {"a", "b", "b.c", "d", "e"}) == {"b", "b.c", "d"}


def test_no_import_cycle_between_the_package_modules_through_deferred_imports():
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    known = set(files)
    graph = {name: all_imports(path, known) - {name} for name, path in files.items()}
    graph = {name: {m for m in deps if not name.startswith(m + ".")} for name, deps in graph.items()}
    assert find_cycle(graph) is None
