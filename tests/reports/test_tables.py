"""Formatting rules of the markdown tables."""

import numpy as np

from prvrlab.reports import stats
from prvrlab.reports.tables import VariantRow, ablation_table, adjusted_cells, bold_best, fmt, fmt_p, md_table


def test_fmt_and_bold():
    assert fmt(-0.04) == "0.0" and fmt(1.25, signed=True) == "+1.2" and fmt(None) == "—" and fmt(float("nan")) == "—"
    assert bold_best(["1.0", "2.0", "3.0"], [1.0, 2.0, 3.0]) == ["1.0", "2.0", "**3.0**"]
    assert md_table(["a", "b"], [["x", "1"]]).splitlines()[1] == "|:--|--:|"


def test_bold_only_a_unique_best_of_several_values():
    assert bold_best(["1.0", "2.0", "2.0"], [1.0, 2.04, 1.96]) == ["1.0", "2.0", "2.0"]
    assert bold_best(["—", "+1.0"], [None, 1.0]) == ["—", "+1.0"]
    assert bold_best(["1.0", "0.5"], [1.0, 0.5], mode="min") == ["1.0", "**0.5**"]
    rows = [
        VariantRow("base", ("loss:a",), (0,), {"sumr": [10.0]}, (0,)),
        VariantRow("other", ("loss:a",), (0,), {"sumr": [12.0]}, (0,)),
    ]
    text = ablation_table(rows, "base", several_seeds=False)
    assert "| **12.0** | +2.0 n.t. | 1/1 |" in text  # no test over queries: marked untested


def test_failed_and_missing_cells_are_shown():
    rows = [
        VariantRow("base", ("loss:a", "loss:b"), (0,), {"r1": [1.0], "r5": [2.0], "r10": [3.0], "r100": [4.0], "sumr": [10.0]}, (0,)),
        VariantRow("crashed", ("loss:a",), (0,), problems={0: "error"}),
        VariantRow("never_ran", None, (0,), problems={0: "missing"}),
    ]
    text = ablation_table(rows, "base", several_seeds=False)
    lines = text.splitlines()
    assert lines[0] == "| Variant | b | R@1 | R@5 | R@10 | R@100 | SumR | ΔSumR | Runs |"
    assert "| crashed | – | *failed* |" in text and "0/1 (1 error)" in text
    assert "| never_ran | ? | *missing* |" in text and "0/1 (1 missing)" in text


def test_a_printed_p_value_never_contradicts_the_verdict():
    assert [fmt_p(p) for p in (0.0123, 0.0496, 0.04995, 0.05, 0.0504, 0.0009)] == [
        "0.012", "0.0496", "0.04995", "0.050", "0.050", "<0.001"]
    for p in np.linspace(0.045, 0.055, 2001):
        assert (float(fmt_p(p)) < stats.ALPHA) == (p < stats.ALPHA), p
    rows = [["a", "", "", ""]]
    assert adjusted_cells(rows, {0: ("a", 50 / 1001)}, "holm", p_col=-2) == {"a": True}  # 1 + 49 of 1000 resamples
    assert rows[0][-2:] == ["0.04995", "yes"]


def test_delta_sumr_bolds_only_a_unique_improvement_above_zero_as_printed():
    def table(*sumr):
        rows = [VariantRow(n, None, (0,), {"sumr": [v]}, (0,), delta_significant=True) for n, v in zip("abc", sumr)]
        return {line.split(" | ")[0].strip("| "): line.split(" | ")[-2] for line in ablation_table(rows, "a", several_seeds=False).splitlines()[2:]}

    assert table(180.0, 180.03, 179.0) == {"a (baseline)": "—", "b": "0.0", "c": "-1.0"}  # +0.03 prints 0.0: no bold
    assert table(180.0, 180.04, 180.02) == {"a (baseline)": "—", "b": "0.0", "c": "0.0"}
    assert table(180.0, 181.0, 179.0)["b"] == "**+1.0**"
    assert table(180.0, 181.02, 180.96)["b"] == "+1.0"  # a tie as printed: no bold
