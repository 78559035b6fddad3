"""Helpers shared by the report tests."""

from __future__ import annotations


def md_rows(md: str, heading: str) -> list[list[str]]:
    """Rows (cells stripped of bold) of the first table after a heading starting with ``heading``."""
    lines = md.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(heading))
    rows = []
    for ln in lines[start + 1 :]:
        if ln.startswith("|"):
            rows.append([c.strip().replace("**", "") for c in ln.strip("|").split("|")])
        elif rows:
            break
    return rows
