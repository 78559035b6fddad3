"""A moment exactly a group's bound long lands in that group whatever rounding the division brought: 1.2 s of
a 6 s video is short however the moment sits in it."""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from prvrlab.data.text import moment_ratios
from prvrlab.evaluation.metrics import GROUP_UPPER, ratio_groups


def _exact_group(start: str, end: str, duration: str) -> str:
    """The group of the exact ratio (decimal timestamps as fractions, no float in the way)."""
    r = (Fraction(end) - Fraction(start)) / Fraction(duration)
    for name, upper in zip(("short", "medium"), GROUP_UPPER):
        if 0 < r <= Fraction(str(upper)):
            return name
    return "long"


def test_a_moment_at_a_bound_is_in_the_lower_group_wherever_it_sits():
    stamps = {"a": (2.4, 3.6, 6.0), "b": (0.0, 1.2, 6.0), "c": (1.1, 3.5, 6.0), "d": (0.0, 2.4, 6.0)}
    ratios = moment_ratios(stamps, list(stamps))
    assert ratios[0] != ratios[1]  # the division's rounding differs: 0.20000000000000004 against 0.19999999999999998
    assert list(ratio_groups(ratios)) == ["short", "short", "medium", "medium"]


def test_every_two_decimal_moment_is_grouped_as_its_exact_ratio():
    rows, expected = {}, []
    for duration in ("5.00", "6.00", "7.50", "12.35", "30.10"):
        cents = round(float(duration) * 100)
        for start in range(0, cents, 7):
            for end in range(start + 1, cents + 1, 3):
                key = f"{duration}:{start}:{end}"
                rows[key] = (start / 100, end / 100, float(duration))
                expected.append(_exact_group(f"{start / 100:.2f}", f"{end / 100:.2f}", duration))
    labels = ratio_groups(moment_ratios(rows, list(rows)))
    assert list(labels) == expected
    assert {"short", "medium", "long"} <= set(expected)


def test_a_ratio_a_little_above_a_bound_is_in_the_next_group():
    assert list(ratio_groups(np.array([0.2 + 1e-6, 0.4 + 1e-6, 1e-12]))) == ["medium", "long", "short"]
    assert list(ratio_groups(np.array([0.2, 0.4], dtype=np.float32))) == ["short", "medium"]
