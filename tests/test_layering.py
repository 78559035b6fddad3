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


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def top_level_imports(path: Path, known: set[str]) -> set[str]:
    """Package modules a file imports at module level (what runs on import), resolved to modules."""
    out = set()
    for node in ast.parse(path.read_text()).body:
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        out.update(n for n in names if n in known)
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (module -> modules), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_a_planted_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_between_the_package_modules():
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    known = set(files)
    graph = {name: top_level_imports(path, known) - {name} for name, path in files.items()}
    # a package's __init__ importing its own modules is not a cycle through the package
    graph = {name: {m for m in deps if not name.startswith(m + ".")} for name, deps in graph.items()}
    assert find_cycle(graph) is None
