"""Value checks shared by every constructor and spec reader (one definition each).

Each returns the checked value (converted where stated) or raises a
``ValueError`` whose message names the parameter and quotes the bad value.
Booleans are never accepted as numbers.
"""

from __future__ import annotations

import math


def is_number(value: object) -> bool:
    """A finite int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_number(value: object, name: str, *, minimum: float | None = None, strict: bool = False) -> float:
    """``value`` as a finite float (>= ``minimum``, or > with ``strict``)."""
    ok = is_number(value)
    if ok and minimum is not None:
        ok = value > minimum if strict else value >= minimum  # type: ignore[operator]
    if not ok:
        bound = "" if minimum is None else f" {'>' if strict else '>='} {minimum:g}"
        raise ValueError(f"{name} must be a finite number{bound}, got {value!r}")
    return float(value)  # type: ignore[arg-type]


def check_int(value: object, name: str, *, minimum: int) -> int:
    """``value`` as an int >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def check_positive_int(value: object, name: str) -> int:
    """``value`` as an int > 0."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


MAX_LAYERS = 256  # a stack's depth: the papers use 1-4; a typo's 10**9 would build for hours before failing


def check_layer_count(value: object, name: str) -> int:
    """``value`` as the number of layers of a stack: an int in [1, MAX_LAYERS]."""
    check_positive_int(value, name)
    if value > MAX_LAYERS:  # type: ignore[operator]
        raise ValueError(f"{name} must be at most {MAX_LAYERS} layers, got {value!r}")
    return value  # type: ignore[return-value]


def check_probability(value: object, name: str) -> float:
    """``value`` as a float in [0, 1)."""
    if not is_number(value) or not 0.0 <= value < 1.0:  # type: ignore[operator]
        raise ValueError(f"{name} must be a number in [0, 1), got {value!r}")
    return float(value)  # type: ignore[arg-type]


def check_identifier(value: object, name: str, example: str) -> str:
    """A non-empty identifier such as a branch name (``example`` shows a valid one)."""
    if not isinstance(value, str) or not value.isidentifier():
        raise ValueError(f"{name} must be a name such as {example}, got {value!r}")
    return value


def check_bool(value: object, name: str) -> bool:
    """``value`` as a bool (``true`` / ``false`` in YAML; 0 and 1 are not accepted)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return value


def check_choice(value: object, name: str, options: tuple[str, ...]) -> str:
    """``value`` as one of ``options``."""
    if value not in options:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, options))}, got {value!r}")
    return value  # type: ignore[return-value]


def first_line(exc: BaseException) -> str:
    """An error's first non-empty line, for a one-line message (torch's C++ errors append a stack of frames);
    its type's name when it has no text."""
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
