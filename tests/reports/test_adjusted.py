"""The confidence tables adjust their query-level p-values over the table's comparisons (Holm by default)."""

from __future__ import annotations

import numpy as np
import pytest

from prvrlab.reports import stats
from prvrlab.reports.report import Doc, Options, confidence_section
from prvrlab.reports.tables import VariantRow

from report_helpers import md_rows

RAW = {"a": 0.01, "b": 0.04, "c": 0.03, "d": 0.005}  # Holm: a 0.03, b 0.06, c 0.06, d 0.02


@pytest.fixture
def table(monkeypatch):
    ranks = {"query_id": np.array([f"q{i}" for i in range(40)]), "rank": np.arange(1, 41)}  # any ranks
    monkeypatch.setattr(
        stats, "paired_test",
        lambda a, b, n_perm, seed: stats.PairedResult(1.0, 0.0, 2.0, RAW[current.pop(0)], len(a)),
    )
    names = ["base", *RAW]
    current = list(RAW)  # the order in which the rows are tested
    rows = [VariantRow(name=n, components=None, seeds_expected=(0,), values={"sumr": [100.0]}, seeds_ok=(0,)) for n in names]
    return rows, {n: {0: ranks} for n in names}


@pytest.mark.parametrize("method", ["holm", "none"])
def test_significance_follows_the_adjusted_p_values(table, tmp_path, method):
    rows, ranks = table
    doc = Doc(tmp_path)
    significance = confidence_section(doc, rows, ranks, "base", "val", Options(n_boot=10, adjust=method))
    expected = dict(zip(RAW, stats.adjust(list(RAW.values()), method)))
    assert significance == {n: p < stats.ALPHA for n, p in expected.items()}
    if method == "holm":
        assert significance == {"a": True, "b": False, "c": False, "d": True}  # b and c pass only unadjusted
    else:
        assert all(significance.values())
    md = "".join(doc.parts)
    table_rows = md_rows(md, "## Confidence (val")
    header = table_rows[0]
    adjusted_col = header.index("p (Holm)" if method == "holm" else "p (unadjusted)")
    assert header[adjusted_col - 1] == "p (queries)" and header[-1] == "Significant"
    body = {r[0]: r for r in table_rows[2:]}
    for name, p in expected.items():
        assert body[name][adjusted_col - 1] == f"{RAW[name]:.3f}"
        assert body[name][adjusted_col] == f"{p:.3f}"
        assert body[name][-1] == ("yes" if p < stats.ALPHA else "no †")
    assert body["base (baseline)"][adjusted_col] == "—"
    assert "the table's 4 comparisons with the baseline" in md


def test_an_unknown_adjustment_is_refused():
    with pytest.raises(ValueError, match="adjust must be one of holm, none, got 'bh'"):
        Options(adjust="bh")


@pytest.mark.parametrize("method", ["holm", "none"])
def test_the_legend_gives_the_smallest_attainable_p_and_says_when_no_row_can_be_significant(tmp_path, method):
    """A huge difference with ``--bootstrap 40`` and 7 comparisons read "not significant" without a word why."""
    rng = np.random.default_rng(0)
    base = {"query_id": np.array([f"q{i}" for i in range(200)]), "rank": rng.integers(1, 50, 200)}
    better = {"query_id": base["query_id"], "rank": np.maximum(1, base["rank"] - 30)}  # far better on every query
    names = ["base", *(f"v{i}" for i in range(7))]
    rows = [VariantRow(name=n, components=None, seeds_expected=(0,), values={"sumr": [100.0]}, seeds_ok=(0,)) for n in names]
    ranks = {n: {0: base if n == "base" else better} for n in names}
    m = len(names) - 1
    for n_boot in (40, 200):
        doc = Doc(tmp_path)
        confidence_section(doc, rows, ranks, "base", "test", Options(n_boot=n_boot, adjust=method))
        text = doc.text()
        smallest = (m if method == "holm" else 1) / (n_boot + 1)  # every row's raw p is 1/(n_boot + 1) here
        assert f"at least 1/{n_boot + 1}" in text
        verdicts = [r[-1] for r in md_rows(text, "## Confidence")[3:]]
        hopeless = "No row can be significant" in text
        assert hopeless == (smallest >= stats.ALPHA) and all(v.startswith("no") for v in verdicts) == hopeless
