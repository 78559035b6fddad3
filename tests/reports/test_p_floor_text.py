"""The legend's smallest attainable p is printed on its side of α: a floor just under 0.05 must not read 0.05."""

from __future__ import annotations

import re

import pytest

from prvrlab.reports import stats
from prvrlab.reports.tables import p_floor_note


NUMBER = r"(\d+(?:\.\d+)?(?:e-\d+)?)"


def _printed(note: str, holm: bool) -> float:
    """The floor the note prints (``holm``: the one after Holm's adjustment)."""
    return float(re.search(NUMBER + " after Holm" if holm else "≈ " + NUMBER, note).group(1))


@pytest.mark.parametrize("m,resamples", [(7, 140), (9, 180), (8, 140), (3, 59), (3, 60), (2, 39), (1, 19), (1, 20)])
def test_the_printed_holm_floor_is_on_the_same_side_of_alpha_as_the_floor(m, resamples):
    floor = 1 / (resamples + 1)
    adjusted = min(1.0, m * floor)
    note = p_floor_note("holm", m, resamples)
    if m > 1:
        printed = _printed(note, holm=True)
        assert (printed < stats.ALPHA) == (adjusted < stats.ALPHA), note
        assert printed == pytest.approx(adjusted, rel=0.05)
    assert ("No row can be significant" in note) == (adjusted >= stats.ALPHA), note
    assert _printed(note, holm=False) == pytest.approx(floor, rel=0.05)


def test_a_tiny_floor_is_printed_as_a_number_not_as_a_bound():
    note = p_floor_note("none", 1, 9999)
    assert "≈ 0.0001" in note and "<0.001" not in note  # two significant digits, as before
