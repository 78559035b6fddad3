"""Formatting rules of the markdown tables."""

import numpy as np

from prvrlab.reports import stats
from prvrlab.reports.tables import VariantRow, ablation_table, adjusted_cells, bold_best, fmt, fmt_p, md_table


def test_fmt_and_bold():
    assert fmt(-0.04) == "0.0" and fmt(1.25, signed=True) == "+1.3" and fmt(None) == "—" and fmt(float("nan")) == "—"
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


def test_one_value_prints_one_way_wherever_it_was_computed():
    """R@1 of 109 hits in 400 queries is 27.250000000000004 as the logged count ratio and 27.25 as the
    confidence table's mean of hits: Python's rounding printed 27.3 and 27.2 in one report."""
    import numpy as np

    from prvrlab.reports.tables import fmt_p

    hits = np.zeros(400)
    hits[:109] = 100.0
    ratio, mean = float((np.arange(400) < 109).mean() * 100), float(hits.mean())
    assert ratio != mean  # the two computations differ in the last bits
    assert fmt(ratio) == fmt(mean) == "27.3"
    for n in (400, 800, 2000):  # every exact half: away from zero, however it was computed
        for k in range(n + 1):
            value = 100 * k / n
            text = f"{value:.12g}"
            if "." in text and len(text.split(".")[1]) == 2 and text.endswith("5"):
                whole, tenths = divmod(int(round(value * 100)) + 5, 100)  # half up, in integer arithmetic
                expected = f"{whole}.{tenths // 10}"
                assert fmt(value) == fmt(float((np.arange(n) < k).mean() * 100)) == expected, (n, k)
                assert fmt(-value, signed=True) == f"-{expected}"
    assert fmt_p(0.0625) == "0.063" and fmt_p(0.1875) == "0.188"  # exact seed-test p-values, half up
    assert fmt_p(0.0496) == "0.0496" and fmt_p(0.04995) == "0.04995" and fmt_p(0.05) == "0.050"  # the side of α kept
    assert bold_best(["27.3", "27.3"], [ratio, mean]) == ["27.3", "27.3"]  # a tie as printed


def test_a_cell_whose_runs_finished_without_the_splits_metrics_says_so_not_failed():
    base = VariantRow("base", ("loss:a",), (0, 1), {"sumr": [10.0, 11.0]}, (0, 1))
    unmeasured = VariantRow("valonly", ("loss:a",), (0, 1), problems={0: "no test metrics", 1: "no test metrics"})
    partly = VariantRow("mixed", ("loss:a",), (0, 1), problems={0: "no test metrics", 1: "missing"})
    crashed = VariantRow("crashed", ("loss:a",), (0, 1), problems={0: "no test metrics", 1: "failed"})
    assert unmeasured.empty_label == partly.empty_label == "no test metrics"
    assert crashed.empty_label == "failed"
    lines = ablation_table([base, unmeasured, crashed], "base", several_seeds=True).splitlines()
    (row,) = [ln for ln in lines if ln.startswith("| valonly")]
    assert "*no test metrics*" in row and "*failed*" not in row
    (row,) = [ln for ln in lines if ln.startswith("| crashed")]
    assert "*failed*" in row
    (row,) = [ln for ln in lines if ln.startswith("| base")]  # finished, logged SumR only: no value, not failed
    assert row.split(" | ")[1:3] == ["—", "—"] and "*" not in row


def test_large_values_keep_their_digits_and_numpy_p_values_print_as_numbers():
    """The 12-digit noise cut dropped digits from 1e12 on (123456789012345.6 printed 123456789012000.0); a numpy
    p-value within the cut of α printed as ``np.float64(...)``."""
    import numpy as np

    from prvrlab.reports.tables import fmt_p

    assert fmt(123456789012345.6) == "123456789012345.6" and fmt(9876543210123.25) == "9876543210123.3"
    assert fmt(12345678901.25) == "12345678901.3" and fmt(1234.5678, 3) == "1234.568"
    assert fmt_p(np.float64(0.049999999999999004)) == "0.049999999999999004"


def test_a_resumed_trial_whose_run_is_open_again_is_running_not_failed(tmp_path):
    """``prvrlab.status: resumed`` marks a trial reopened after a killed driver; while it runs its cell is *running*."""
    from prvrlab.reports.report import Options, write_report
    from prvrlab.reports.source import TrialRun

    from report_helpers import fake_run, fake_study, md_rows

    base = [fake_run("base", 0, [1, 2, 30])]

    def open_cell(tags: dict) -> TrialRun:
        return TrialRun("c0", "c0", "RUNNING", 0, {"prvrlab.variant": "c", "prvrlab.seed": "0", **tags}, {}, {})

    for tags, label in [({"prvrlab.status": "resumed"}, "running"), ({}, "running")]:
        study = fake_study(base + [open_cell(tags)], {}, baseline="base", seeds=[0])
        md = write_report(study, tmp_path / label, Options(n_boot=20)).read_text()
        row = next(r for r in md_rows(md, "## Ablation") if r[0] == "c")
        assert row[1] == f"*{label}*", row
    assert TrialRun("c0", "c0", "KILLED", 0, {"prvrlab.status": "resumed"}, {}, {}).status == "resumed"
