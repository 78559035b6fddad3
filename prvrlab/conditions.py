"""``when`` conditions of a search space, shared by the search (sampling) and the reports (reading trials).

A condition compares the value a config key took with an expectation: a plain
value (equality), a list (membership) or a one-entry mapping ``{op: value}``
with ``op`` one of :data:`CONDITION_OPS`.
"""

from __future__ import annotations

from typing import Any

CONDITION_OPS = {
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
    ">": lambda a, b: a is not None and a > b,
    ">=": lambda a, b: a is not None and a >= b,
    "<": lambda a, b: a is not None and a < b,
    "<=": lambda a, b: a is not None and a <= b,
    "in": lambda a, b: a in b,
    "not_in": lambda a, b: a not in b,
}


def condition_holds(actual: Any, expected: Any) -> bool:
    """A ``when`` condition: a value (equality), a list (membership) or {op: value}."""
    if isinstance(expected, dict):
        ((op, value),) = expected.items()
        return bool(CONDITION_OPS[op](actual, value))
    if isinstance(expected, list):
        return actual in expected
    return actual == expected
