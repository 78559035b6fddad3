"""Legend wording: a count of one comparison is singular (it read 'the table's 1 comparisons')."""

from __future__ import annotations

from prvrlab.reports.tables import adjusted_legend


def test_one_comparison_is_singular():
    assert "the table's 1 comparison with the baseline," in adjusted_legend("holm", 1, "comparisons with the baseline", 1000)
    assert "the table's 3 comparisons with the baseline," in adjusted_legend("holm", 3, "comparisons with the baseline", 1000)
    assert "the table's 1 comparison with the reference (" in adjusted_legend("none", 1, "comparisons with the reference", 1000)

