"""Markdown tables in the papers' format (GitHub-renderable, paste-able into a paper).

Plain functions over plain data: no MLflow here.  Numbers use one decimal for
R@K and SumR (as the PRVR papers do; halves round away from zero, after binary noise is cut, so one value
prints one way wherever it was computed: :func:`rounded`), a signed one-decimal ΔSumR, p-values
with three decimals (more when three would round one below α up to α); a missing value is ``—`` and a cell without any finished
run says ``failed`` or ``missing``.  The best value of each metric column is
bold when it is unique at the printed precision and the column has more than one value (ΔSumR: the largest
improvement, only when it prints above 0.0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from decimal import ROUND_HALF_UP, Decimal
from typing import Any, Sequence

from prvrlab.evaluation.metrics import METRIC_KEYS
from prvrlab.reports import stats

METRIC_NAMES: dict[str, str] = {m: f"R@{m[1:]}" if m != "sumr" else "SumR" for m in METRIC_KEYS}
CHECK, CROSS = "✓", "–"
DASH = "—"
NOT_SIGNIFICANT = "†"
NOT_TESTED = "n.t."
NOT_TESTED_LEGEND = (
    f"{NOT_TESTED} = not tested over queries (no ranks on the seeds the variant shares with the baseline, "
    "or no query in common with its ranks)."
)
SUBSET = "‡"  # a comparison made on the seeds both rows share, fewer than all the seeds of one of them


# ---------------------------------------------------------------- formatting


def rounded(value: float, digits: int = 1) -> Decimal | float:
    """``value`` at ``digits`` decimals, halves away from zero, once binary noise is cut (12 significant
    digits, where they reach a decimal below the printed ones): R@1 of 109 hits in 400 queries is
    27.250000000000004 as a count ratio and 27.25 as a mean of hits, and both print 27.3 (Python's ``round``
    and ``format`` gave 27.3 and 27.2).  Magnitudes of 1e15 and above are returned as they are."""
    if not math.isfinite(value) or abs(value) >= 1e15:
        return value
    text = f"{value:.12g}" if abs(value) < 10.0 ** (11 - digits) else repr(float(value))  # larger: every digit
    return Decimal(text).quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP)


def fmt(value: float | None, digits: int = 1, signed: bool = False) -> str:
    """Fixed decimals (:func:`rounded`), no negative zero; None / non-finite -> ``—``."""
    if value is None or not math.isfinite(value):
        return DASH
    shown = rounded(value, digits)
    text = f"{shown:+.{digits}f}" if signed else f"{shown:.{digits}f}"
    zero = f"{0:.{digits}f}"
    if text.lstrip("+-") == zero:
        return zero
    return text


def fmt_sig(value: float | None, digits: int = 4) -> str:
    """``digits`` significant digits (for values of any scale), no negative zero; None / non-finite -> ``—``."""
    if value is None or not math.isfinite(value):
        return DASH
    text = f"{value:.{digits}g}"
    return "0" if text == "-0" else text


def fmt_p(p: float | None) -> str:
    """A p-value: three decimals, ``<0.001`` below, and as many more as keep it on its side of α
    (0.0496 prints 0.0496, not 0.050: it is significant)."""
    if p is None or not math.isfinite(p):
        return DASH
    if p < 0.001:
        return "<0.001"
    digits = 3
    alpha = Decimal(repr(stats.ALPHA))  # as written (a float compared with a Decimal is its binary value)
    while (rounded(p, digits) < alpha) != (p < stats.ALPHA):
        if digits >= 12:  # closer to α than the noise cut: every digit
            return repr(float(p))
        digits += 1
    return fmt(p, digits)


def fmt_param(value: Any) -> str:
    """A hyperparameter value: 4 significant digits for floats."""
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def escape(text: str) -> str:
    """Make free text safe inside a table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ").strip()


def recall_text(values: dict[str, float | None], signed: bool = False) -> str:
    """``R@1 13.9  R@5 33.3 ...`` for the metrics given (keys ``r1`` ... ``sumr``), signed for differences."""
    return "  ".join(f"{METRIC_NAMES[k]} {fmt(v, signed=signed)}" for k, v in values.items())


def delta_cell(delta: float, low: float, high: float) -> str:
    """A signed difference with its interval: ``+1.2 [-0.3, +2.8]``."""
    return f"{fmt(delta, signed=True)} [{fmt(low, signed=True)}, {fmt(high, signed=True)}]"


def adjusted_header(method: str) -> str:
    """The column of p-values adjusted over a table's comparisons (``stats.ADJUSTMENTS``)."""
    return "p (Holm)" if method == "holm" else "p (unadjusted)"


def adjusted_legend(method: str, m: int, family: str, resamples: int) -> str:
    """The legend sentence of :func:`adjusted_header`'s column, for ``m`` comparisons named ``family`` tested
    with ``resamples`` sign vectors each (which bound the smallest p the table can show)."""
    if m == 0:
        return f"{adjusted_header(method)}: none of the table's {family} was tested over queries, so none adjusted."
    if method == "holm":
        text = (f"p (Holm): the same p-values adjusted by Holm–Bonferroni over the table's {_count(m, family)}, so that "
                f"the chance of any false \"significant\" in the table stays below α = {stats.ALPHA}.")
    else:
        text = f"p (unadjusted): not adjusted for the table's {_count(m, family)} (`--adjust none`)."
    return f"{text} {p_floor_note(method, m, resamples)}"


def _count(m: int, family: str) -> str:
    """'3 comparisons with the baseline', '1 comparison with the baseline'."""
    return f"{m} {family.replace('comparisons', 'comparison', 1) if m == 1 else family}"


def _floor_text(p: float) -> str:
    """A smallest attainable p in two significant digits, or as :func:`fmt_p` keeps it on its side of α where
    those would cross it (7/141 prints 0.0496, not 0.05)."""
    text = f"{p:.2g}"
    return text if (float(text) < stats.ALPHA) == (p < stats.ALPHA) else fmt_p(p)


def p_floor_note(method: str, m: int, resamples: int) -> str:
    """The smallest p the permutation test over queries can give (1/(resamples + 1); Holm: m times that), and a
    warning when it cannot reach α, so that no row of the table can be significant whatever its difference."""
    floor = 1.0 / (resamples + 1)
    adjusted = min(1.0, m * floor) if method == "holm" else floor
    text = f"With {resamples} resamples a p over queries is at least 1/{resamples + 1} ≈ {_floor_text(floor)}"
    text += f" ({_floor_text(adjusted)} after Holm over {m})." if method == "holm" and m > 1 else "."
    if adjusted >= stats.ALPHA:
        need = math.ceil((m if method == "holm" else 1) / stats.ALPHA)  # resamples + 1 > m / α
        text += (f" **No row can be significant at α = {stats.ALPHA} with so few resamples**: give `--bootstrap` "
                 f"{need} or more.")
    return text


def adjusted_cells(table_rows: list[list[str]], tested: dict[int, tuple[str, float]], method: str, p_col: int) -> dict[str, bool]:
    """Fill the adjusted-p column (``p_col``) and the last (Significant) column of the tested rows;
    returns name -> significant.  ``tested``: table row -> (name, raw p)."""
    adjusted = stats.adjust([p for _, p in tested.values()], method)
    significance = {}
    for (row, (name, _)), p in zip(tested.items(), adjusted):
        significance[name] = p < stats.ALPHA
        table_rows[row][p_col] = fmt_p(p)
        table_rows[row][-1] = "yes" if significance[name] else f"no {NOT_SIGNIFICANT}"
    return significance


def md_table(header: Sequence[str], rows: Sequence[Sequence[str]], align: Sequence[str] | None = None) -> str:
    """A GitHub markdown table; ``align`` per column: 'l', 'c' or 'r' (default: first left, rest right)."""
    align = list(align or (["l"] + ["r"] * (len(header) - 1)))
    marks = {"l": ":--", "c": ":-:", "r": "--:"}
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(marks[a] for a in align) + "|"]
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"row has {len(row)} cells, header has {len(header)}: {row!r}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def bold_best(cells: list[str], values: list[float | None], mode: str = "max", digits: int = 1) -> list[str]:
    """Bold the one cell whose value is the best at the printed precision; nothing on a tie or a single value."""
    shown = [rounded(v, digits) for v in values if v is not None and math.isfinite(v)]
    if len(shown) < 2:
        return cells
    best = max(shown) if mode == "max" else min(shown)
    if shown.count(best) > 1:
        return cells
    return [
        f"**{c}**" if v is not None and math.isfinite(v) and rounded(v, digits) == best else c
        for c, v in zip(cells, values)
    ]


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    n = len(values)
    mean = math.fsum(values) / n
    if n < 2:
        return mean, 0.0
    return mean, math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))


# ---------------------------------------------------------------- ablation table


@dataclass
class VariantRow:
    """One variant of an ablation: per-seed metric values and what went wrong."""

    name: str
    components: tuple[str, ...] | None  # None: no run carried them
    seeds_expected: tuple[int, ...]
    values: dict[str, list[float]] = field(default_factory=dict)  # metric -> finite values over usable seeds
    seeds_ok: tuple[int, ...] = ()
    problems: dict[int, str] = field(default_factory=dict)  # seed -> failed | nonfinite | error | killed | missing | ...
    delta_significant: bool | None = None  # query-level paired test vs the baseline (None: not tested)

    @property
    def sumr_by_seed(self) -> dict[int, float]:
        """Seed -> SumR of each usable seed (a seed is usable only with a SumR)."""
        return dict(zip(self.seeds_ok, self.values.get("sumr") or []))

    def mean(self, metric: str) -> float | None:
        xs = self.values.get(metric) or []
        return mean_std(xs)[0] if xs else None

    @property
    def empty_label(self) -> str:
        """What a metric cell says when no seed finished."""
        kinds = set(self.problems.values())
        if kinds and kinds <= {"missing"}:
            return "missing"
        if "running" in kinds and not (kinds - {"running", "missing"}):
            return "running"
        unmeasured = {k for k in kinds if k.startswith("no ") and k.endswith(" metrics")}  # finished, not on the split
        if unmeasured and not (kinds - unmeasured - {"running", "missing"}):
            return min(unmeasured)
        return "failed"


def seed_deltas(row: VariantRow, base: VariantRow) -> dict[int, float]:
    """Seed -> the row's SumR minus the baseline's, on the seeds both finished."""
    mine, theirs = row.sumr_by_seed, base.sumr_by_seed
    return {s: v - theirs[s] for s, v in mine.items() if s in theirs}


def fewer_seeds(shared: Sequence[int], *own: Sequence[int]) -> bool:
    """Whether a comparison on the ``shared`` seeds leaves out some seed of one of the compared rows."""
    return any(set(shared) != set(o) for o in own)


def paired_subsets(rows: Sequence[VariantRow], baseline: str) -> dict[str, list[int]]:
    """Variant -> the seeds of its ΔSumR, for the variants whose shared seeds with the baseline are fewer
    than all of the variant's or of the baseline's."""
    base = next((r for r in rows if r.name == baseline), None)
    out = {}
    for r in rows:
        shared = list(seed_deltas(r, base)) if base is not None and r is not base else []
        if shared and fewer_seeds(shared, r.seeds_ok, base.seeds_ok):
            out[r.name] = shared
    return out


def untested(rows: Sequence[VariantRow], baseline: str) -> list[str]:
    """The variants with a ΔSumR but no test over queries (``delta_significant`` None)."""
    base = next((r for r in rows if r.name == baseline), None)
    return [r.name for r in rows if base is not None and r is not base and seed_deltas(r, base) and r.delta_significant is None]


def seeds_text(seeds: Sequence[int]) -> str:
    """'seed 2' or 'seeds 0, 1'."""
    return ("seed " if len(seeds) == 1 else "seeds ") + ", ".join(str(s) for s in seeds)


def subset_note(subsets: dict[str, Sequence[int]], what: str) -> str:
    """The legend of :data:`SUBSET` for rows compared on fewer seeds (name -> the seeds used); '' for none."""
    if not subsets:
        return ""
    named = "; ".join(f"{escape(name)} ({seeds_text(seeds)})" for name, seeds in subsets.items())
    return f"{SUBSET} {what}, not on all the seeds of the variant or of the baseline: {named}."


def variant_label(name: str, baseline: str) -> str:
    """A variant's name in a table cell, marked when it is the baseline."""
    return f"{escape(name)} (baseline)" if name == baseline else escape(name)


def component_label(token: str) -> str:
    """'loss:query_diverse' -> 'query_diverse'; 'backbone:gmmformer' -> 'gmmformer'."""
    return token.split(":", 1)[1] if ":" in token else token


def varying_components(rows: Sequence[VariantRow]) -> list[str]:
    """Component tokens present in some variants but not all (sorted: backbone, plugin, loss, then name)."""
    sets = [set(r.components) for r in rows if r.components is not None]
    if not sets:
        return []
    union = set().union(*sets)
    common = set.intersection(*sets)
    order = {"backbone": 0, "plugin": 1, "loss": 2}
    return sorted(union - common, key=lambda t: (order.get(t.split(":", 1)[0], 3), t))


def _seed_cell(row: VariantRow) -> str:
    n_ok, n_all = len(row.seeds_ok), len(row.seeds_expected)
    text = f"{n_ok}/{n_all}" if n_all else str(n_ok)
    bad = sorted(set(row.problems.values()))
    if bad:
        counts = [f"{sum(1 for v in row.problems.values() if v == b)} {b}" for b in bad]
        text += " (" + ", ".join(counts) + ")"
    return text


def ablation_table(rows: Sequence[VariantRow], baseline: str, *, several_seeds: bool) -> str:
    """One row per variant: ✓/– per varying component, R@K and SumR (mean ± std over its seeds), ΔSumR (on the
    seeds it shares with the baseline, :data:`SUBSET` when fewer than either's own), seeds."""
    comps = varying_components(rows)
    labels = [component_label(c) for c in comps]
    if len(set(labels)) != len(labels):
        labels = comps
    header = ["Variant", *labels, *(METRIC_NAMES[m] for m in METRIC_KEYS), "ΔSumR", "Seeds" if several_seeds else "Runs"]
    align = ["l", *("c" for _ in comps), *("r" for _ in METRIC_KEYS), "r", "r"]
    base = next((r for r in rows if r.name == baseline), None)
    subsets = paired_subsets(rows, baseline)

    columns: list[list[str]] = []
    for m in METRIC_KEYS:
        cells, values = [], []
        for r in rows:
            xs = r.values.get(m) or []
            if not xs:  # a row with finished seeds that did not log this metric: no value, not a failure
                cells.append(DASH if r.seeds_ok else f"*{r.empty_label}*")
                values.append(None)
                continue
            mean, std = mean_std(xs)
            cells.append(f"{fmt(mean)} ± {fmt(std)}" if several_seeds and len(xs) > 1 else fmt(mean))
            values.append(mean)
        columns.append(bold_best(cells, values))
    delta_cells, delta_values = [], []
    for r in rows:
        deltas = seed_deltas(r, base) if base is not None and r is not base else {}
        if not deltas:
            delta_cells.append(DASH)
            delta_values.append(None)
        else:
            d = mean_std(list(deltas.values()))[0]
            marks = [SUBSET] if r.name in subsets else []
            marks += [NOT_SIGNIFICANT] if r.delta_significant is False else [NOT_TESTED] if r.delta_significant is None else []
            delta_cells.append(" ".join([fmt(d, signed=True), *marks]))
            delta_values.append(d)
    improved = any(v is not None and rounded(v, 1) > 0 for v in delta_values)  # as printed: a 0.0 is no improvement
    delta_cells = bold_best(delta_cells, delta_values) if improved else delta_cells

    out_rows = []
    for i, r in enumerate(rows):
        name = variant_label(r.name, baseline)
        marks = ["?" if r.components is None else (CHECK if c in r.components else CROSS) for c in comps]
        out_rows.append([name, *marks, *(col[i] for col in columns), delta_cells[i], _seed_cell(r)])
    return md_table(header, out_rows, align)


# ---------------------------------------------------------------- grouped metric tables


def metric_table(
    first: Sequence[str],
    rows: Sequence[tuple[Sequence[str], dict[str, list[float]]]],
    *,
    bold: bool = True,
    lead_align: Sequence[str] | None = None,
) -> str:
    """Rows of leading cells + mean R@K / SumR over the given values (one decimal)."""
    header = [*first, *(METRIC_NAMES[m] for m in METRIC_KEYS)]
    align = list(lead_align or ["l"] * len(first)) + ["r"] * len(METRIC_KEYS)
    columns = []
    for m in METRIC_KEYS:
        values = [mean_std(v[m])[0] if v.get(m) else None for _, v in rows]
        cells = [fmt(x) for x in values]
        columns.append(bold_best(cells, values) if bold else cells)
    out = []
    for i, (lead, _) in enumerate(rows):
        out.append([*lead, *(col[i] for col in columns)])
    return md_table(header, out, align)


def kv_table(pairs: Sequence[tuple[str, str]]) -> str:
    """A two-column key/value table."""
    return md_table(["", ""], [[f"**{k}**", v] for k, v in pairs], ["l", "l"])
