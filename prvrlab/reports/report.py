"""Assemble ``report.md`` (+ PNGs) for a search or ablation read from MLflow.

Determinism: rows follow the spec's order (variants) or sorted keys, ties are
broken by trial id, floats are printed with fixed decimals, the bootstrap and
permutation tests use ``numpy.random.default_rng(seed)`` per table cell, the
Optuna importances a seeded fANOVA, and nothing time-dependent is written —
re-running on the same runs gives byte-identical markdown (``--profile``
timings excepted: they are measurements).
"""

from __future__ import annotations

import ast
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import yaml

from prvrlab.conditions import condition_holds
from prvrlab.evaluation.metrics import GROUPS, METRIC_KEYS, group_bounds
from prvrlab.reports import plots, stats
from prvrlab.reports.errors import ReportError
from prvrlab.reports.latex import latex_tables
from prvrlab.reports.source import (
    TRAIN_PREFIX, Study, TrialRun, check_split, ground_truth_difference, load_study, run_cache, yaml_numbers,
)
from prvrlab.reports.tables import (
    DASH,
    METRIC_NAMES,
    NOT_SIGNIFICANT,
    NOT_TESTED,
    NOT_TESTED_LEGEND,
    SUBSET,
    VariantRow,
    ablation_table,
    adjusted_cells,
    adjusted_header,
    adjusted_legend,
    bold_best,
    delta_cell,
    escape,
    fmt,
    fmt_p,
    fmt_param,
    fmt_sig,
    fewer_seeds,
    kv_table,
    md_table,
    mean_std,
    metric_table,
    paired_subsets,
    recall_text,
    seed_deltas,
    seeds_text,
    subset_note,
    untested,
    variant_label,
)

LATEX_FILE = "tables.tex"  # beside report.md
TOP_TRIALS = 10
CURVES = 3
CI_TRIALS = 5
FEW_TRIALS = 10  # fewer completed trials than this: the importances carry a caveat
CI_METRICS = ("sumr", *(m for m in METRIC_KEYS if m != "sumr"))  # column order of the confidence tables


@dataclass
class Options:
    """How to write a report. ``profile`` (an efficiency section) needs two callables injected: ``read_config``
    turns a run's logged ``config.yaml`` into a validated config (the CLI passes the platform's validator) and
    ``measure(cfg, name=...)`` builds and measures its model (the CLI passes
    :func:`prvrlab.evaluation.profile.profile_config`), so the reports never build a model themselves."""

    split: str | None = None  # None: test when the runs have it, else val
    n_boot: int = 1000
    seed: int = 0
    profile: bool = False
    galleries: Sequence[int] | None = None  # None: those ``measure`` defaults to
    read_config: Callable[[dict[str, Any]], Any] | None = None
    measure: Callable[..., Any] | None = None
    adjust: str = "holm"  # a table's query-level p-values adjusted for its number of comparisons: holm | none

    def __post_init__(self) -> None:
        if self.adjust not in stats.ADJUSTMENTS:
            raise ValueError(f"adjust must be one of {', '.join(stats.ADJUSTMENTS)}, got {self.adjust!r}")


@dataclass
class Doc:
    """The report being written: its markdown parts (figures are written into ``out``)."""

    out: Path
    parts: list[str] = field(default_factory=list)

    def add(self, text: str) -> None:
        self.parts.append(text.rstrip("\n") + "\n")

    def section(self, title: str) -> None:
        self.add(f"## {title}")

    def figure(self, name: str, caption: str) -> None:
        self.add(f"![{caption}]({name})")

    def text(self) -> str:
        return "\n".join(self.parts)


class _FloatNames(ast.NodeTransformer):
    """The names ``inf`` and ``nan`` as the floats Python prints that way (a logged ``[inf]``)."""

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id in ("inf", "nan"):
            return ast.copy_location(ast.Constant(float(node.id)), node)
        return node


def _literal(text: str) -> Any:
    """A Python literal as ``str()`` wrote it into an MLflow param, ``inf`` and ``nan`` included."""
    return ast.literal_eval(_FloatNames().visit(ast.parse(text.strip(), mode="eval")))


def _parse(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    for parser in (_literal, yaml.safe_load):
        try:
            return parser(value)
        except Exception:
            continue
    return value


def pick_split(study: Study, split: str | None) -> str:
    if split is not None:
        return split
    if any(r.final("test", "sumr") is not None for r in study.runs):
        return "test"
    return "val"


def _has_groups(runs: Sequence[TrialRun], split: str) -> bool:
    return any(r.final(split, f"{g}/sumr") is not None for r in runs for g in GROUPS)


# ---------------------------------------------------------------- ablation


def _spec_variants(study: Study) -> tuple[list[str], str, list[int]]:
    spec = study.spec
    variants = list((spec.get("variants") or {}).keys())
    if not variants:
        variants = sorted(k[len("variant.") :] for k in study.params if k.startswith("variant."))
    seen = sorted({r.variant for r in study.runs if r.variant} - set(variants))
    variants += seen
    baseline = spec.get("baseline") or _parse(study.params.get("spec.baseline")) or (variants[0] if variants else "")
    seeds = spec.get("seeds") or _parse(study.params.get("spec.seeds"))
    if not isinstance(seeds, list):
        seeds = sorted({r.seed for r in study.runs if r.seed is not None})
    order = [baseline] + [v for v in variants if v != baseline] if baseline in variants else variants
    return order, str(baseline), [int(s) for s in seeds]


def _choose(cands: list[TrialRun]) -> TrialRun | None:
    """The run standing for a cell: a usable one first, then the latest."""
    if not cands:
        return None
    return sorted(cands, key=lambda r: (not r.ok, r.status != "finished", -r.start_time, r.run_id))[0]


def ablation_cells(study: Study, split: str) -> tuple[list[VariantRow], dict[str, dict[int, TrialRun]], str, list[int]]:
    """Variant rows (values from MLflow) and the run chosen per (variant, seed)."""
    order, baseline, seeds = _spec_variants(study)
    rows, chosen = [], {}
    for v in order:
        by_seed: dict[int, TrialRun] = {}
        row = VariantRow(name=v, components=None, seeds_expected=tuple(seeds))
        runs_v = [r for r in study.runs if r.variant == v]
        comp_src = _choose(runs_v)
        row.components = comp_src.components if comp_src is not None and comp_src.components else None
        ok = []
        for s in sorted(set(seeds) | {r.seed for r in runs_v if r.seed is not None}):
            run = _choose([r for r in runs_v if r.seed == s])
            if run is None:
                row.problems[s] = "missing"
                continue
            by_seed[s] = run
            if not run.ok:
                row.problems[s] = run.status
                continue
            if run.final(split, "sumr") is None:
                row.problems[s] = f"no {split} metrics"
                continue
            ok.append(s)
            for m in METRIC_KEYS:
                value = run.final(split, m)
                if value is not None:
                    row.values.setdefault(m, []).append(value)
        row.seeds_ok = tuple(ok)
        rows.append(row)
        chosen[v] = by_seed
    return rows, chosen, baseline, seeds


def ranks_by_seed(study: Study, rows: list[VariantRow], chosen, split: str) -> dict[str, dict[int, dict[str, Any] | None]]:
    """Variant -> finished seed -> the run's per-query ranks on ``split`` (None: it logged none)."""
    return {r.name: {s: study.ranks(chosen[r.name][s], split) for s in r.seeds_ok} for r in rows}


def _seed_hits(loaded: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray] | None:
    """(query ids, hit matrix averaged over the runs' ranks) on the queries all of them share."""
    if not loaded:
        return None
    common = sorted(set.intersection(*(set(x["query_id"].tolist()) for x in loaded)))
    if not common:
        return None
    mats = []
    for x in loaded:
        pos = {q: i for i, q in enumerate(x["query_id"].tolist())}
        mats.append(stats.hits(x["rank"][[pos[q] for q in common]]))
    return np.asarray(common), np.mean(mats, axis=0)


def _ci_cell(iv: stats.Interval) -> str:
    return f"{fmt(iv.value)} [{fmt(iv.low)}, {fmt(iv.high)}]"


def _ci_headers() -> list[str]:
    return [f"{METRIC_NAMES[m]} [95% CI]" for m in CI_METRICS]


def confidence_section(doc: Doc, rows: list[VariantRow], ranks, baseline: str, split: str, opt: Options) -> dict[str, bool]:
    """Bootstrap CIs per variant (over its finished seeds with ranks) and paired tests vs the baseline: over
    queries on the seeds both finished with ranks (p adjusted over the table's comparisons: ``opt.adjust``), over
    seeds on the seeds both finished; ``ranks``: :func:`ranks_by_seed`.  Returns variant -> significant."""
    ranked = {name: {s: x for s, x in by_seed.items() if x is not None} for name, by_seed in ranks.items()}
    base_row = next((r for r in rows if r.name == baseline), None)
    base_ranked = ranked.get(baseline, {})
    table_rows, tested, subsets, disjoint = [], {}, {}, []
    for r in rows:
        own = ranked[r.name]
        h = _seed_hits(list(own.values()))
        cells = [DASH] * len(CI_METRICS)
        if h is not None:
            ci = stats.bootstrap_ci(hit_matrix=h[1], n_boot=opt.n_boot, seed=opt.seed)
            cells = [_ci_cell(ci[m]) for m in CI_METRICS]
        delta = p_q = p_s = p_t = verdict = DASH
        if r.name != baseline and base_row is not None:
            paired = [s for s in own if s in base_ranked]
            hv, hb = (_seed_hits([x[s] for s in paired]) for x in (own, base_ranked))
            moved = any(ground_truth_difference(own[s], base_ranked[s]) for s in paired)
            aligned = _aligned(hv, hb, r.name, disjoint, moved)
            if aligned is not None:
                pr = stats.paired_test(*aligned, n_perm=opt.n_boot, seed=opt.seed)
                delta = delta_cell(pr.delta, pr.low, pr.high)
                if fewer_seeds(paired, own, base_ranked):
                    delta += f" {SUBSET}"
                    subsets[r.name] = paired
                p_q = fmt_p(pr.p_value)
                tested[len(table_rows)] = (r.name, pr.p_value)
            else:
                verdict = NOT_TESTED
            shared = seed_deltas(r, base_row)
            if shared:
                st = stats.seed_test([r.sumr_by_seed[s] for s in shared], [base_row.sumr_by_seed[s] for s in shared])
                sampled = f", {st.resamples} sign vectors drawn" if st.resamples else ""
                p_s = fmt_p(st.p_exact) + (f" (n={st.n}, min {fmt_p(st.min_p)}{sampled})" if st.n else "")
                p_t = fmt_p(st.p_ttest)
        table_rows.append([variant_label(r.name, baseline), *cells, delta, p_q, DASH, p_s, p_t, verdict])
    significance = adjusted_cells(table_rows, tested, opt.adjust, p_col=-4)
    header = ["Variant", *_ci_headers(), "ΔSumR [95% CI]", "p (queries)", adjusted_header(opt.adjust),
              "p (seeds, exact)", "p (seeds, t-test)", "Significant"]
    doc.section(f"Confidence ({split}, 95% bootstrap over queries)")
    doc.add(md_table(header, table_rows))
    doc.add(
        f"Intervals: percentile bootstrap over the {split} queries ({opt.n_boot} resamples, seed {opt.seed}) of the "
        "metric averaged over the variant's finished seeds with ranks (per-query hits averaged first). ΔSumR: "
        "variant minus baseline on the seeds both finished with ranks (hits averaged over those seeds) and the "
        "queries both share, with a paired-bootstrap interval; p (queries): two-sided sign-flip "
        f"permutation test on the per-query SumR differences ({opt.n_boot} resamples); "
        + adjusted_legend(opt.adjust, len(tested), "comparisons with the baseline", opt.n_boot)
        + " p (seeds): exact two-sided sign-flip test over the per-seed SumR differences on the seeds both finished "
        "(min = smallest p attainable with that many seeds; above 16 seeds, 2^16 sign vectors drawn) and a paired t-test. "
        f"{NOT_SIGNIFICANT} = not significant at α = {stats.ALPHA} ({_adjusted_name(opt.adjust)})."
        + (f" {NOT_TESTED_LEGEND}" if any(row[-1] == NOT_TESTED for row in table_rows) else "")
    )
    notes = [subset_note(subsets, "ΔSumR and p (queries) on the seeds both finished with ranks"),
             _no_ranks_note(ranks, split), _disjoint_note(disjoint, "the baseline", split)]
    if any(notes):
        doc.add(" ".join(n for n in notes if n))
    return significance


def _aligned(a: tuple[np.ndarray, np.ndarray] | None, b: tuple[np.ndarray, np.ndarray] | None, name: str,
             disjoint: list[str], moved: bool = False) -> tuple[np.ndarray, np.ndarray] | None:
    """``stats.align`` of two (query ids, hits); None when either is None, or when the two were evaluated on
    other data (``moved``: a shared query has another ground-truth video; or no query in common): then
    ``name`` is added to ``disjoint`` and the comparison is not tested."""
    if a is None or b is None:
        return None
    if not moved:
        try:
            return stats.align(*a, *b)
        except stats.NoSharedQueries:
            pass
    disjoint.append(name)
    return None


def _disjoint_note(names: list[str], against: str, split: str) -> str:
    """Which rows were evaluated on other data than ``against`` (their tests over queries were not made)."""
    if not names:
        return ""
    named = ", ".join(f"`{escape(n)}`" for n in names)
    return (f"Evaluated on other {split} data than {against} (no query in common, or a shared query with another "
            f"ground-truth video), so not tested over queries: {named}.")


def _no_ranks_note(ranks, split: str) -> str:
    """Which finished seeds of which variants logged no ranks (left out of the query-level statistics)."""
    missing = {name: [s for s, x in by_seed.items() if x is None] for name, by_seed in ranks.items()}
    named = "; ".join(f"{escape(name)} {seeds_text(seeds)}" for name, seeds in missing.items() if seeds)
    if not named:
        return ""
    return (f"Finished without a ranks artifact (`ranks/ranks_{split}.parquet`), so left out of the intervals and "
            f"the tests over queries (the tests over seeds use their final metrics): {named}.")


def _adjusted_name(method: str) -> str:
    return "queries test, Holm-adjusted" if method == "holm" else "queries test, unadjusted"


def ratio_section(doc: Doc, entries: list[tuple[str, list[TrialRun]]], split: str, what: str = "Variant") -> None:
    """Per-variant (or per-trial) metrics in the short / medium / long moment-ratio groups."""
    rows = []
    for name, runs in entries:
        for g in GROUPS:
            values = {m: [v for v in (r.final(split, f"{g}/{m}") for r in runs) if v is not None] for m in METRIC_KEYS}
            counts = [r.final(split, f"{g}/count") for r in runs]
            count = next((int(c) for c in counts if c is not None), None)
            rows.append(([escape(name), g, DASH if count is None else str(count)], values))
    doc.section(f"Moment/video-ratio breakdown ({split})")
    doc.add(metric_table([what, "Group", "Queries"], rows, bold=False, lead_align=["l", "l", "r"]))
    bounds = group_bounds()
    ranges = ", ".join(f"{name}{' r ∈' if i == 0 else ''} ({low:g}, {high:g}]" for i, (name, low, high) in enumerate(bounds))
    doc.add(f"Groups by moment/video duration ratio r: {ranges}; mean over seeds.")


def component_section(
    doc: Doc, study: Study, entries: list[tuple[str, list[TrialRun]]], what: str, curves: Sequence[TrialRun] = ()
) -> None:
    """Last-epoch value of each ``train/<component>.<name>`` metric per variant (mean ± std over its runs) or
    per trial, and a learning-curve figure per metric over ``curves``; nothing when no child run logged one."""
    keys = sorted({k for r in study.runs for k in r.component_metrics})
    if not keys:
        return
    rows = []
    for label, runs in entries:
        cells = []
        for key in keys:
            values = [r.component_metrics[key] for r in runs if key in r.component_metrics]
            mean, std = mean_std(values) if values else (None, 0.0)
            cells.append(f"{fmt_sig(mean)} ± {fmt_sig(std, 2)}" if len(values) > 1 else fmt_sig(mean))
        rows.append([label, *cells])
    doc.section("Component metrics (last epoch)")
    doc.add(md_table([what, *(f"`{escape(k)}`" for k in keys)], rows))
    several = any(len(runs) > 1 for _, runs in entries)
    doc.add(f"What the losses and plug-ins report every epoch (MLflow `{TRAIN_PREFIX}<component>.<name>`): the value "
            f"of the last epoch{', mean ± sample std (n − 1) over the finished seeds' if several else ''}; — = not logged.")
    for key in keys:
        points = [(r.trial_id, study.history(r, TRAIN_PREFIX + key)) for r in curves if key in r.component_metrics]
        if points:
            name = f"component_{plots.safe_name(key)}.png"
            plots.learning_curves(points, doc.out / name, ylabel=key, title=f"{key} per epoch (best trials)")
            doc.figure(name, f"{key} per epoch of {len(points)} of the best trials")


QUANTILES = (0.1, 0.5, 0.9)


def merged_distributions(study: Study, entries: list[tuple[str, list[TrialRun]]]) -> dict[str, list[tuple[str, dict[str, Any]]]]:
    """``<component>.<name>`` -> [(label, record)] with each entry's runs merged: bin counts and n summed,
    means weighted by n.  Bins of other edges cannot be summed: the entry keeps the edges most of its runs
    logged (a tie: the first run's) and names the others in the record's ``left_out``."""
    out: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    per_run = {r.run_id: study.distributions(r) for _, runs in entries for r in runs}
    keys = sorted({k for records in per_run.values() for k in records})
    for key in keys:
        for label, runs in entries:
            logged = [(r, per_run[r.run_id][key]) for r in runs if key in per_run[r.run_id]]
            if not logged:
                continue
            edges = [tuple(rec["edges"]) for _, rec in logged]
            kept = max(dict.fromkeys(edges), key=edges.count)
            records = [rec for (_, rec), e in zip(logged, edges) if e == kept]
            left_out = [f"seed {r.seed}" if r.seed is not None else r.name for (r, _), e in zip(logged, edges) if e != kept]
            merged: dict[str, dict[str, Any]] = {}
            for rec in records:
                for name, ser in rec["series"].items():
                    m = merged.setdefault(name, {"counts": [0] * len(ser["counts"]), "n": 0, "sum": 0.0})
                    m["counts"] = [a + b for a, b in zip(m["counts"], ser["counts"])]
                    m["n"] += ser["n"]
                    m["sum"] += ser["mean"] * ser["n"] if ser["n"] else 0.0
            epochs = sorted({int(rec.get("epoch", 0)) for rec in records})
            out.setdefault(key, []).append(
                (label, {"edges": records[0]["edges"], "series": merged, "epochs": epochs, "left_out": left_out}))
    return out


def distribution_section(doc: Doc, study: Study, entries: list[tuple[str, list[TrialRun]]], what: str) -> None:
    """Every ``distributions/<component>.<name>.json`` artifact of the runs: a table of n, mean and
    quantiles per entry and series, and a figure with one panel per entry; nothing when no run has one."""
    merged = merged_distributions(study, entries)
    if not merged:
        return
    doc.section("Distributions")
    doc.add("Distributions that losses and plug-ins log (run artifacts `distributions/<component>.<name>.json`), "
            "the runs of an entry merged (bin counts summed over its seeds); mean over the values themselves, "
            "quantiles interpolated within the bins; epoch = the training epoch whose hook logged it (counted from 1).")
    for key, rows in merged.items():
        table = []
        for label, rec in rows:
            for name, ser in rec["series"].items():
                mean = ser["sum"] / ser["n"] if ser["n"] else None
                quantiles = [stats.histogram_quantile(rec["edges"], ser["counts"], q) for q in QUANTILES]
                table.append([label, escape(name), f"{ser['n']:,}", fmt_sig(mean),
                              *(fmt_sig(x) for x in quantiles),
                              ", ".join(str(e) for e in rec["epochs"])])
        doc.add(f"### `{escape(key)}`")
        doc.add(md_table([what, "Series", "n", "Mean", *(f"q{int(q * 100)}" for q in QUANTILES), "Epoch"], table,
                         ["l", "l", "r", "r", "r", "r", "r", "r"]))
        left = [f"{label}: {', '.join(escape(x) for x in rec['left_out'])}" for label, rec in rows if rec["left_out"]]
        if left:
            doc.add(f"Left out (bin edges other than those most runs of the {what.lower()} logged, which cannot be "
                    f"summed with them): {'; '.join(left)}.")
        name = f"distribution_{plots.safe_name(key)}.png"
        panels = [(label, rec["edges"], {n: ser["counts"] for n, ser in rec["series"].items()}) for label, rec in rows]
        plots.distribution_plot(panels, doc.out / name, xlabel=key, title=f"{key}: density per series")
        doc.figure(name, f"{key} per {what.lower()}")


def _ablation_sweeps(study: Study, rows: list[VariantRow], chosen) -> dict[str, list[tuple[Any, TrialRun]]]:
    """Config keys that take at least 3 values across the variants -> [(value, run)], one at a time: a variant
    counts for a key only when the key is all its overrides change (or it changes none: the baseline), so a
    variant that also changes other keys is not credited to this one."""
    variants = study.spec.get("variants") or {}
    keys = sorted({k for ov in variants.values() if isinstance(ov, dict) for k in ov})
    out = {}
    for key in keys:
        points = []
        for r in rows:
            changed = variants.get(r.name)
            if not isinstance(changed, dict) or set(changed) - {key}:
                continue
            for s in r.seeds_ok:
                run = chosen[r.name][s]
                if key in run.params:
                    points.append((_parse(run.params[key]), run))
        if len({_hashable(v) for v, _ in points}) >= 3:
            out[key] = points
    return out


def sensitivity_section(doc: Doc, sweeps: dict[str, list[tuple[Any, TrialRun]]], space: dict[str, Any], split: str) -> None:
    """One table (+ figure) per swept key: rows per value, or bins for continuous keys. ``sweeps``: key ->
    [(value, run)] of the runs that set the key (a ``None`` value is a value: the key set to null)."""
    if not sweeps:
        return
    doc.section(f"Sensitivity ({split})")
    doc.add(f"Runs: those with final {split} metrics, which the means are over (k of n: the other n − k runs with "
            "that value stopped early without final metrics).")
    for key in sorted(sweeps):
        points = sweeps[key]
        if not points:
            continue
        dist = space.get(key) or {}
        kind = next((k for k in dist if k != "when"), "choice") if isinstance(dist, dict) else "choice"
        shown: dict[Any, Any] = {}  # hashable form -> the value as first seen (lists stay lists)
        for v, _ in points:
            shown.setdefault(_hashable(v), v)
        distinct = [shown[h] for h in sorted(shown, key=_sort_value)]
        continuous = kind in ("loguniform", "uniform") or (kind == "int" and len(distinct) > 8)
        log = kind == "loguniform"
        groups: list[tuple[str, Any, list[TrialRun]]] = []  # (table label, x of the figure's mean, runs)
        if continuous and len(distinct) > 1:
            lo, hi = (float(x) for x in dist[kind]) if kind in dist else (float(distinct[0]), float(distinct[-1]))
            n_bins = min(4, len(distinct))
            tr = (math.log10 if log else float)
            edges = [tr(lo) + (tr(hi) - tr(lo)) * i / n_bins for i in range(n_bins + 1)]
            edges = [10**e for e in edges] if log else edges
            for i in range(n_bins):
                members = [r for v, r in points if (edges[i] <= float(v) < edges[i + 1]) or (i == n_bins - 1 and float(v) >= edges[i])
                           or (i == 0 and float(v) < edges[0])]
                if members:
                    close = "]" if i == n_bins - 1 else ")"
                    centre = math.sqrt(edges[i] * edges[i + 1]) if log else (edges[i] + edges[i + 1]) / 2
                    groups.append((f"[{fmt_param(edges[i])}, {fmt_param(edges[i + 1])}{close}", centre, members))
        else:
            for d in distinct:
                groups.append((fmt_param(d), d, [r for v, r in points if _hashable(v) == _hashable(d)]))
        rows = []
        for label, _, members in groups:
            vals = {m: [x for x in (r.final(split, m) for r in members) if x is not None] for m in METRIC_KEYS}
            done = sum(1 for r in members if r.final(split, "sumr") is not None)
            rows.append(([label, str(done) if done == len(members) else f"{done} of {len(members)}"], vals))
        doc.add(f"**{escape(key)}**" + (" (binned, log scale)" if continuous and log else " (binned)" if continuous else ""))
        doc.add(metric_table([escape(key), "Runs"], rows, lead_align=["l", "r"]))
        fig_points = [(shown[_hashable(v)], r.final(split, "sumr")) for v, r in points if r.final(split, "sumr") is not None]
        means = []
        for _, x, members in groups:
            ys = [y for y in (r.final(split, "sumr") for r in members) if y is not None]
            if ys:
                means.append((x, mean_std(ys)[0]))
        if fig_points:
            name = f"sensitivity_{plots.safe_name(key)}.png"
            plots.sensitivity_plot(key, fig_points, doc.out / name, means=means, binned=continuous and len(distinct) > 1, log=log,
                                   categorical=not continuous and not _numeric(distinct),
                                   title=f"{split} SumR against {key}")
            doc.figure(name, f"SumR against {key}")


def _numeric(values) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def _hashable(v: Any) -> Any:
    """A value as a set member and dict key: lists as tuples, mappings as sorted items (recursively)."""
    if isinstance(v, (list, tuple)):
        return tuple(_hashable(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted(((str(k), _hashable(x)) for k, x in v.items()), key=lambda kv: kv[0]))
    return v


def _sort_value(v) -> tuple:
    """Numbers by value, then other scalars (``None`` included) by text, then sequences element by element."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return (0, float(v), "", ())
    if isinstance(v, (list, tuple)):
        return (2, 0.0, "", tuple(_sort_value(x) for x in v))
    return (1, 0.0, str(v), ())


def problems_section(doc: Doc, runs: list[TrialRun], missing: list[str]) -> None:
    """Failed / killed / unfinished runs and missing cells, never dropped silently."""
    bad = [r for r in runs if not r.ok]
    if not bad and not missing:
        return
    doc.section("Failed, unfinished and missing runs")
    rows = []
    for r in bad:
        label = r.tags.get("prvrlab.cell") or r.trial_id
        err = escape(r.error.strip().splitlines()[-1] if r.error.strip() else "")
        rows.append([escape(label), r.status, f"`{r.run_id}`", err[:160] or DASH])
    for cell in missing:
        rows.append([escape(cell), "missing", DASH, "no run in MLflow"])
    doc.add(md_table(["Cell / trial", "Status", "Run", "Error"], rows, ["l", "l", "l", "l"]))


def ablation_report(doc: Doc, study: Study, opt: Options) -> None:
    study, earlier = study.of_latest_configs()
    split = pick_split(study, opt.split)
    rows, chosen, baseline, seeds = ablation_cells(study, split)
    several = len(seeds) > 1
    doc.add(f"# Ablation: {escape(study.name)}")
    counts = _status_counts(study.runs)
    missing = [f"{r.name}/seed{s}" for r in rows for s, p in sorted(r.problems.items()) if p == "missing"]
    doc.add(kv_table([
        ("Parent run", f"`{study.parent_id}`"),
        ("Split", split),
        ("Baseline", escape(baseline)),
        ("Variants", str(len(rows))),
        ("Seeds", ", ".join(str(s) for s in seeds) or DASH),
        ("Runs", _counts_text(counts) + (f", {len(missing)} missing" if missing else "")
         + (f"; {earlier} of earlier configurations of these cells left out (another base config, `--set` or "
            "default than the latest submission's: their config hash differs)" if earlier else "")),
        ("Metric", f"{study.metric} ({study.mode})"),
    ]))
    variant_overrides = study.spec.get("variants") or {}
    if variant_overrides:
        doc.section("Variants")
        doc.add(md_table(
            ["Variant", "Overrides of the base config"],
            [[escape(r.name), escape("; ".join(f"{k} = {_fmt_value(v)}" for k, v in (variant_overrides.get(r.name) or {}).items()) or DASH)]
             for r in rows],
            ["l", "l"],
        ))
    significance = {}
    ranks = ranks_by_seed(study, rows, chosen, split)
    conf = Doc(doc.out)
    base_row = next((r for r in rows if r.name == baseline), None)
    seed_pairs = base_row is not None and any(r.name != baseline and len(seed_deltas(r, base_row)) > 1 for r in rows)
    if seed_pairs or any(x is not None for by_seed in ranks.values() for x in by_seed.values()):
        significance = confidence_section(conf, rows, ranks, baseline, split, opt)  # tests over seeds need no ranks
    for r in rows:
        r.delta_significant = significance.get(r.name)
    doc.section(f"Ablation ({split})")
    doc.add(ablation_table(rows, baseline, several_seeds=several))
    legend = [f"{'Mean ± sample std (n − 1) over seeds; ' if several else ''}R@K in %, SumR = R@1 + R@5 + R@10 + R@100; "
              f"ΔSumR: the variant's SumR minus the baseline's on the seeds both finished (mean of the per-seed "
              "differences); a unique best value per column in bold (in ΔSumR the largest improvement, when it is "
              "unique and above 0.0 as printed); ✓ / – = component on / off (run tag `components`)."]
    if significance:
        legend.append(f"{NOT_SIGNIFICANT} difference not significant (p ≥ {stats.ALPHA}, paired sign-flip test over queries "
                      "on the seeds both finished with ranks, "
                      f"{'Holm-adjusted over the table' if opt.adjust == 'holm' else 'unadjusted'}).")
    if untested(rows, baseline):
        legend.append(NOT_TESTED_LEGEND)
    legend.append(subset_note(paired_subsets(rows, baseline), "ΔSumR on the seeds both finished"))
    legend.append(saturation_note([v for r in rows for v in r.values.get("r100") or []]))
    legend.append(published_note(next((r for r in rows if r.name == baseline), None), chosen, split))
    doc.add(" ".join(x for x in legend if x))
    doc.parts.extend(conf.parts)
    if _has_groups([chosen[r.name][s] for r in rows for s in r.seeds_ok], split):
        ratio_section(doc, [(r.name, [chosen[r.name][s] for s in r.seeds_ok]) for r in rows], split)
    entries = [(variant_label(r.name, baseline), [chosen[r.name][s] for s in r.seeds_ok]) for r in rows]
    component_section(doc, study, entries, "Variant")
    distribution_section(doc, study, entries, "Variant")
    sweeps = _ablation_sweeps(study, rows, chosen)
    sensitivity_section(doc, sweeps, {}, split)
    if opt.profile:
        _profile_section(doc, study, [(r.name, chosen[r.name][r.seeds_ok[0]] if r.seeds_ok else next(iter(chosen[r.name].values()), None)) for r in rows], opt)
    problems_section(doc, study.runs, missing)


def published_note(row: VariantRow | None, chosen: dict[str, dict[int, TrialRun]], split: str) -> str:
    """The baseline config's published result on ``split`` beside the baseline's mean ('' without one)."""
    runs = [chosen[row.name][s] for s in row.seeds_ok] if row else []
    published = next((r.published(split) for r in runs), None)
    if published is None:
        return next((escape(note) for r in runs if (note := r.published_elsewhere(split))), "")
    source, values = published
    parts = []
    for m, v in values.items():
        ours = row.mean(m)
        parts.append(f"{METRIC_NAMES[m]} {fmt(v)}" + (f" (baseline {fmt(ours - v, signed=True)})" if ours is not None else ""))
    return f"Published ({escape(source)}, {split}): {', '.join(parts)}."


def _fmt_value(value: Any) -> str:
    """A variant override as YAML would show it (``[.inf]``, ``0``, ``average``)."""
    return yaml.safe_dump(value, default_flow_style=True, width=1000).strip().removesuffix("...").strip()


# ---------------------------------------------------------------- search


def _space(study: Study) -> dict[str, dict[str, Any]]:
    space = study.spec.get("space")
    if isinstance(space, dict) and space:
        return space
    out = {}
    for k, v in study.params.items():
        if k.startswith("space."):
            out[k[len("space."):]] = yaml_numbers(_parse(v))
    return dict(sorted(out.items()))


def _active(space: dict[str, Any], run: TrialRun) -> dict[str, Any]:
    """The searched values of a trial (conditional keys only when their condition held)."""
    chosen: dict[str, Any] = {}
    for key, dist in space.items():
        when = (dist or {}).get("when") or {}
        if all(condition_holds(chosen.get(k, _parse(run.params.get(k))), v) for k, v in when.items()):
            if key in run.params:
                chosen[key] = _parse(run.params[key])
    return chosen


SEARCHED_VALUE = "the best the trial reported over its epochs and its final evaluation, as the search ranks trials"


def objective(study: Study, run: TrialRun) -> float | None:
    """The searched metric of a trial as the search ranks trials (``tuning.best_trial``: the best of every
    report): the best of its per-epoch history and ``final/<metric>`` (the final round, when it ran)."""
    values = [v for _, v in study.history(run, study.metric)]
    final = run.metrics.get(f"final/{study.metric}")
    if final is not None:
        values.append(final)
    values = [v for v in values if math.isfinite(v)]
    if not values:
        return None
    return max(values) if study.mode == "max" else min(values)


@dataclass
class Importances:
    """fANOVA importances over the searched keys every trial set, and the keys left out."""

    values: dict[str, float]  # key -> importance (they sum to 1)
    trials: int  # the trials they rest on: every trial given
    left_out: dict[str, int]  # searched key some trial did not set -> the number of trials that set it


def _distributions(space: dict[str, Any]) -> dict[str, Any]:
    """Key -> the Optuna distribution of its values; a ``choice`` / ``grid`` key's value is its index in the spec."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    dists = {}
    for key, dist in space.items():
        kind = next((k for k in dist if k != "when"), None)
        args = dist[kind]
        if kind == "loguniform":
            dists[key] = FloatDistribution(float(args[0]), float(args[1]), log=True)
        elif kind == "uniform":
            dists[key] = FloatDistribution(float(args[0]), float(args[1]))
        elif kind == "int":
            dists[key] = IntDistribution(int(args[0]), int(args[1]))
        else:
            dists[key] = CategoricalDistribution(list(range(len(args))))
    return dists


def _internal(space: dict[str, Any], dists: dict[str, Any], key: str, value: Any) -> Any:
    """``value`` of ``key`` as its distribution holds it (a choice's index), None when it is none of the spec's."""
    from optuna.distributions import CategoricalDistribution, IntDistribution

    dist = dists[key]
    if isinstance(dist, CategoricalDistribution):
        choices = next(v for k, v in space[key].items() if k != "when")
        return next((i for i, c in enumerate(choices) if _hashable(c) == _hashable(value) or str(c) == str(value)), None)
    try:
        return int(value) if isinstance(dist, IntDistribution) else float(value)
    except (TypeError, ValueError):
        return None


def importances(space: dict[str, Any], trials: list[tuple[dict[str, Any], float]], seed: int) -> Importances | str:
    """Optuna fANOVA importances on an in-memory study rebuilt from the trials (or why not).

    Only the searched keys every trial set take part: fANOVA keeps just the trials that have every parameter
    it is asked about, so a conditional key (set only where its ``when`` held) would drop the other trials and
    leave the key deciding the condition without the variation it explains. Such keys are ``left_out``."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    dists = _distributions(space)
    rebuilt = []
    for params, value in trials:
        internal = {k: _internal(space, dists, k, v) for k, v in params.items() if k in dists}
        rebuilt.append(({k: v for k, v in internal.items() if v is not None}, value))
    counts = {key: sum(1 for p, _ in rebuilt if key in p) for key in dists}
    common = [key for key in dists if counts[key] == len(rebuilt)]
    left_out = {key: n for key, n in counts.items() if n < len(rebuilt)}
    varying = [k for k in common if len({params[k] for params, _ in rebuilt}) > 1]
    if len(trials) < 2 or not varying:
        reason = "not enough completed trials with varying values to estimate importances"
        if left_out:
            reason += f" (keys not set in every trial are left out: {', '.join(left_out)})"
        return reason
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=seed))
    for params, value in rebuilt:
        study.add_trial(optuna.trial.create_trial(value=float(value), params={k: params[k] for k in common},
                                                  distributions={k: dists[k] for k in common}))
    try:
        result = optuna.importance.get_param_importances(
            study, evaluator=optuna.importance.FanovaImportanceEvaluator(seed=seed), params=varying
        )
    except Exception as exc:  # fANOVA needs complete trials that all share the params
        return f"importances unavailable: {exc}"
    return Importances(dict(result), len(rebuilt), left_out)


def left_out_note(imp: Importances, space: dict[str, Any]) -> str:
    """Why keys are missing from the importances ('' when none is)."""
    if not imp.left_out:
        return ""
    parts = []
    for key, n in imp.left_out.items():
        why = ": sampled only when its `when` condition holds" if (space.get(key) or {}).get("when") else ""
        parts.append(f"`{escape(key)}` (set in {n} of {imp.trials} trials{why})")
    named = "; ".join(parts)
    return (f" Left out, not set in every trial: {named}. fANOVA uses only the trials that set every parameter it "
            "rates, so rating such a key would drop the other trials and with them the variation of the key its "
            "condition depends on.")


def saturation_note(r100: Sequence[float | None]) -> str:
    """A note when every printed R@100 is 100.0 (the gallery has at most ~100 videos); '' otherwise."""
    shown = [fmt(v) for v in r100 if v is not None and math.isfinite(v)]
    if not shown or any(x != "100.0" for x in shown):
        return ""
    return ("R@100 is 100.0 in every row: it is saturated on this gallery size (≤ 100 videos) "
            "and does not tell the rows apart; SumR then differs by R@1/5/10 only.")


def importance_caveat(n_trials: int) -> str:
    """A warning appended to the importances when they rest on few trials ('' otherwise)."""
    if n_trials >= FEW_TRIALS:
        return ""
    return f" **Based on {n_trials} trial{'' if n_trials == 1 else 's'} only; treat as indicative.**"


def published_pairs(run: TrialRun, split: str) -> list[tuple[str, str]]:
    """Rows for the published result of the run's config on ``split`` and the run's difference to it."""
    published = run.published(split)
    if published is None:
        elsewhere = run.published_elsewhere(split)
        return [] if elsewhere is None else [("Published", escape(elsewhere))]
    source, values = published
    deltas = {m: None if (ours := run.final(split, m)) is None else ours - v for m, v in values.items()}
    return [(f"Published ({escape(source)})", recall_text(values)), ("This run − published", recall_text(deltas, signed=True))]


def rank_trials(study: Study, scored: list[tuple[TrialRun, float]]) -> list[tuple[TrialRun, float]]:
    """Trials best first; a tie goes to the trial the search named best (the parent's ``prvrlab.best_trial``:
    ``tuning.best_trial`` keeps the first in start order), then to start order (``prvrlab.trial_number``)."""
    sign = -1.0 if study.mode == "max" else 1.0
    named = study.tags.get("prvrlab.best_trial")

    def key(item: tuple[TrialRun, float]) -> tuple:
        run, value = item
        number = run.tags.get("prvrlab.trial_number", "")
        return sign * value, run.trial_id != named, int(number) if number.isdigit() else math.inf, run.trial_id

    return sorted(scored, key=key)


def search_report(doc: Doc, study: Study, opt: Options) -> None:
    split = pick_split(study, opt.split)
    space = _space(study)
    keys = list(space)
    scored = []
    for r in study.runs:
        value = objective(study, r) if r.ok else None
        scored.append((r, value))
    ranked = rank_trials(study, [(r, v) for r, v in scored if v is not None])
    doc.add(f"# Search: {escape(study.name)}")
    counts = _status_counts(study.runs)
    doc.add(kv_table([
        ("Parent run", f"`{study.parent_id}`"),
        ("Split", split),
        ("Metric", f"{study.metric} ({study.mode})"),
        ("Trials", _counts_text(counts)),
        ("Searched", ", ".join(f"`{escape(k)}`" for k in keys) or DASH),
    ]))
    doc.section("Best trial")
    if not ranked:
        doc.add("*No trial finished with a value of the metric.*")
    else:
        best, value = ranked[0]
        pairs = [("Trial", f"`{best.trial_id}`"), ("Run", f"`{best.run_id}`"), (study.metric, fmt(value, 2))]
        pairs += [(f"`{escape(k)}`", fmt_param(v)) for k, v in _active(space, best).items()]
        pairs += [(f"{split} {METRIC_NAMES[m]}", fmt(best.final(split, m))) for m in METRIC_KEYS]
        pairs += published_pairs(best, split)
        doc.add(kv_table(pairs))
        doc.add(f"{study.metric}: the searched value, {SEARCHED_VALUE}; {split} R@K and SumR: the trial's best model. "
                f"Full config: artifact `config.yaml` of run `{best.run_id}`.")
    if ranked:
        doc.section(f"Top trials ({split})")
        header = ["#", "Trial", "Status", *(f"`{escape(k)}`" for k in keys), *(METRIC_NAMES[m] for m in METRIC_KEYS), study.metric]
        top = ranked[:TOP_TRIALS]
        cols = []
        for m in METRIC_KEYS:
            vals = [r.final(split, m) for r, _ in top]
            cols.append(bold_best([fmt(v) for v in vals], vals))
        obj = bold_best([fmt(v, 2) for _, v in top], [v for _, v in top], study.mode, 2)
        rows = []
        for i, (r, _) in enumerate(top):
            act = _active(space, r)
            rows.append([str(i + 1), f"`{r.trial_id}`", r.status, *(fmt_param(act[k]) if k in act else DASH for k in keys),
                         *(c[i] for c in cols), obj[i]])
        doc.add(md_table(header, rows, ["r", "l", "l", *("r" for _ in keys), *("r" for _ in METRIC_KEYS), "r"]))
        doc.add(f"R@K and SumR: the trial's best model on {split} (— when the trial was stopped early); "
                f"{study.metric}: the searched value, {SEARCHED_VALUE}."
                + (" " + saturation_note([r.final(split, "r100") for r, _ in top])).rstrip())
    early = [(r, v) for r, v in scored if r.status == "early_stopped"]
    doc.section("Stopped early")
    if early:
        rows = [[f"`{r.trial_id}`", *(fmt_param(_active(space, r).get(k)) if k in _active(space, r) else DASH for k in keys),
                 str(len(study.history(r, study.metric))), fmt(v, 2)] for r, v in early]
        doc.add(md_table(["Trial", *(f"`{escape(k)}`" for k in keys), "Epochs", study.metric], rows))
    else:
        doc.add("*None.*")
    doc.section("Parameter importances")
    complete = [(_active(space, r), v) for r, v in ranked]
    imp = importances(space, complete, opt.seed) if space else "no search space recorded"
    if isinstance(imp, str):
        doc.add(f"*{escape(imp)}.*")
    else:
        rows = [[f"`{escape(k)}`", fmt(v, 3)] for k, v in sorted(imp.values.items(), key=lambda kv: (-round(kv[1], 6), kv[0]))]
        doc.add(md_table(["Hyperparameter", "Importance"], rows))
        doc.add(f"fANOVA (Optuna, seed {opt.seed}) on {imp.trials} trials rebuilt from MLflow (every trial with a "
                f"value of {study.metric}), over the searched keys all of them set; importances sum to 1."
                + left_out_note(imp, space) + importance_caveat(imp.trials))
    if ranked:
        curves = [(f"{r.trial_id} ({fmt(v, 1)})", study.history(r, study.metric)) for r, v in ranked[:CURVES]]
        if any(points for _, points in curves):
            doc.section("Learning curves")
            plots.learning_curves(curves, doc.out / "learning_curves.png", ylabel=study.metric,
                                  title=f"{study.metric} per epoch of the best trials (searched value in brackets)")
            doc.figure("learning_curves.png", f"{study.metric} per epoch of the best {len(curves)} trials")
        top = [r for r, _ in ranked[:TOP_TRIALS]]
        component_section(doc, study, [(f"`{r.trial_id}`", [r]) for r in top], "Trial", curves=top[:CURVES])
        _search_confidence(doc, study, ranked[:CI_TRIALS], split, opt)
        if _has_groups([ranked[0][0]], split):
            ratio_section(doc, [(f"{ranked[0][0].trial_id} (best)", [ranked[0][0]])], split, "Trial")
    active = [(_active(space, r), r) for r, _ in ranked]
    sweeps = {k: [(act[k], r) for act, r in active if k in act] for k in keys}  # a trial that did not set k: none
    sensitivity_section(doc, sweeps, space, split)
    if opt.profile and ranked:
        _profile_section(doc, study, [(f"best ({ranked[0][0].trial_id})", ranked[0][0])], opt)
    problems_section(doc, [r for r in study.runs if r.status != "early_stopped"], [])


def _search_confidence(doc: Doc, study: Study, top: list[tuple[TrialRun, float]], split: str, opt: Options) -> None:
    """The top trials' intervals and paired tests against the reference: the best trial, or the best one with
    ranks when the best logged none (said so); trials without ranks are named, not dropped silently."""
    loaded = [(r, study.ranks(r, split)) for r, _ in top]
    bare = [r for r, x in loaded if x is None]
    loaded = [(r, x) for r, x in loaded if x is not None]
    if not loaded:
        return
    ref_run, ref = loaded[0]
    ref_is_best = ref_run is top[0][0]
    ref_name = "best" if ref_is_best else "reference"
    rows, tested, disjoint = [], {}, []
    ref_hits = (ref["query_id"], stats.hits(ref["rank"]))
    for r, x in loaded:
        h = stats.hits(x["rank"])
        ci = stats.bootstrap_ci(hit_matrix=h, n_boot=opt.n_boot, seed=opt.seed)
        cells = [_ci_cell(ci[m]) for m in CI_METRICS]
        delta = p = DASH
        moved = r is not ref_run and ground_truth_difference(x, ref) is not None
        aligned = None if r is ref_run else _aligned((x["query_id"], h), ref_hits, r.trial_id, disjoint, moved)
        if aligned is not None:
            pr = stats.paired_test(*aligned, n_perm=opt.n_boot, seed=opt.seed)
            delta = delta_cell(pr.delta, pr.low, pr.high)
            p = fmt_p(pr.p_value)
            tested[len(rows)] = (r.trial_id, pr.p_value)
        rows.append([f"`{r.trial_id}`" + (f" ({ref_name})" if r is ref_run else ""), *cells, delta, p, DASH, DASH])
    adjusted_cells(rows, tested, opt.adjust, p_col=-2)
    doc.section(f"Confidence ({split}, 95% bootstrap over queries)")
    doc.add(md_table(["Trial", *_ci_headers(), f"ΔSumR vs {ref_name} [95% CI]", "p (queries)", adjusted_header(opt.adjust),
                      "Significant"], rows))
    against = "the best one" if ref_is_best else (f"the reference `{ref_run.trial_id}`, the best trial with ranks "
                                                  f"(the best, `{top[0][0].trial_id}`, logged none),")
    doc.add(f"Percentile bootstrap over queries ({opt.n_boot} resamples, seed {opt.seed}); each trial against {against} "
            f"with a two-sided paired sign-flip test on per-query SumR. "
            + adjusted_legend(opt.adjust, len(tested), f"comparisons with the {ref_name} trial", opt.n_boot)
            + f" {NOT_SIGNIFICANT} = not significant at α = {stats.ALPHA} ({_adjusted_name(opt.adjust)}).")
    if disjoint:
        doc.add(_disjoint_note(disjoint, f"the {ref_name} trial", split))
    if bare:
        named = ", ".join(f"`{r.trial_id}`" + (" (the best)" if r is top[0][0] else "") for r in bare)
        doc.add(f"Left out, no ranks artifact (`ranks/ranks_{split}.parquet`): {named}.")


# ---------------------------------------------------------------- shared


def _status_counts(runs: list[TrialRun]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in runs:
        counts[r.status] = counts.get(r.status, 0) + 1
    return counts


def _counts_text(counts: dict[str, int]) -> str:
    order = ["finished", "early_stopped", "time_limited", "nonfinite", "error", "killed"]
    keys = [k for k in order if k in counts] + sorted(k for k in counts if k not in order)
    return ", ".join(f"{counts[k]} {k.replace('_', '-')}" for k in keys) or "no runs"


def _profile_section(doc: Doc, study: Study, entries: list[tuple[str, TrialRun | None]], opt: Options) -> None:
    from prvrlab.reports.profile import profile_table

    if opt.read_config is None or opt.measure is None:
        raise ReportError(
            "an efficiency profile needs Options.read_config (logged config -> validated config) and "
            "Options.measure (validated config -> measured model)"
        )
    sizes = {"galleries": tuple(opt.galleries)} if opt.galleries else {}
    results = []
    for name, run in entries:
        if run is None:
            continue
        dst = run_cache(study.cache_dir(), run.run_id) / "config"
        try:
            local = study.client.download_artifacts(run.run_id, "config.yaml", str(dst))
        except Exception:
            continue
        cfg = opt.read_config(yaml.safe_load(Path(local).read_text()))
        results.append(opt.measure(cfg, name=name, device="cpu", **sizes))
    if results:
        doc.section("Efficiency")
        doc.add(profile_table(results))
        doc.add("Measured by `prvrlab profile` on each variant's config (random weights and inputs); timings vary between runs.")


def write_report(study: Study, out: str | Path, opt: Options | None = None) -> Path:
    """Write ``out/report.md`` and its figures; returns the markdown path. A ``split`` no run logged is
    refused (ReportError naming the closest) before anything is written."""
    opt = opt or Options()
    if opt.split is not None:
        check_split(study.runs, opt.split)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    doc = Doc(out)
    if study.kind == "ablation":
        ablation_report(doc, study, opt)
    else:
        search_report(doc, study, opt)
    source = (f"Generated by `prvrlab report` from MLflow experiment {study.experiment_id}, parent run "
              f"`{study.parent_id}`; bootstrap {opt.n_boot} resamples, seed {opt.seed}.")
    doc.add(f"<sub>{source} The tables in LaTeX (booktabs): `{LATEX_FILE}`.</sub>")
    path = out / "report.md"
    path.write_bytes(doc.text().encode("utf-8"))
    (out / LATEX_FILE).write_bytes(latex_tables(doc.text(), source=source.replace("`", "")).encode("utf-8"))
    return path


def figures_of(path: str | Path) -> list[str]:
    """The figure files a written ``report.md`` links, in order."""
    return re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", Path(path).read_text(encoding="utf-8"))


def written_text(path: str | Path) -> str:
    """What a report run wrote: 'report.md and 3 figures', '... and 1 figure', '... and no figure'; with
    the LaTeX tables beside it, '... and 3 figures, with its tables in LaTeX (tables.tex)'."""
    n = len(figures_of(path))
    tex = Path(path).with_name(LATEX_FILE)
    tables = f", with its tables in LaTeX ({tex.name})" if tex.is_file() else ""
    return f"{path} and " + ("no figure" if n == 0 else "1 figure" if n == 1 else f"{n} figures") + tables


def report(
    *,
    tracking_uri: str,
    parent_id: str,
    out: str | Path | None = None,
    options: Options | None = None,
    log_artifact: bool = True,
) -> Path:
    """Write the report of the study ``parent_id`` (see ``source.find_parent``) and log what it wrote
    (``report.md``, ``tables.tex`` and the figures it links; nothing else in ``out``) as artifact
    ``report/`` of the parent run; returns the markdown path."""
    with load_study(tracking_uri, parent_id) as study:
        out = Path(out) if out is not None else Path("results") / "reports" / plots.safe_name(study.name)
        path = write_report(study, out, options)
    if log_artifact:
        for name in report_files(path):
            folder = Path(name).parent.as_posix()
            study.client.log_artifact(parent_id, str(path.parent / name), "report" if folder == "." else f"report/{folder}")
    return path


def report_files(path: str | Path) -> list[str]:
    """The files a written ``report.md`` consists of, relative to its folder: itself, ``tables.tex`` when
    written, and the figures it links that are inside the folder."""
    path = Path(path)
    names = [path.name] + ([LATEX_FILE] if (path.parent / LATEX_FILE).is_file() else [])
    root = path.parent.resolve()
    for figure in figures_of(path):
        target = (path.parent / figure).resolve()
        if target.is_file() and target.is_relative_to(root) and figure not in names:
            names.append(figure)
    return names


__all__ = ["Options", "ReportError", "figures_of", "report", "report_files", "write_report", "written_text"]
