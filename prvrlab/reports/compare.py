"""``prvrlab compare``: any training runs side by side on one split, with query-level significance.

The first run is the reference.  Each row shows a run's final R@K and SumR as logged
(``final/<split>/*``); every other run's ΔSumR against the reference comes with a paired-bootstrap
95% interval and a two-sided sign-flip test over the queries both runs ranked (their
``ranks/ranks_<split>.parquet`` artifacts, :mod:`prvrlab.reports.stats`), p-values adjusted over the
table's comparisons (Holm by default).  A run's config ``published`` row on the split is shown too.
No study is needed: the runs may come from ``prvrlab train``, a search or an ablation.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Sequence

from prvrlab.evaluation.metrics import METRIC_KEYS
from prvrlab.reports import stats
from prvrlab.reports.errors import ReportError
from prvrlab.reports.source import TrialRun, check_split, mlflow_client, run_ranks, trial_run
from prvrlab.reports.tables import (
    DASH,
    METRIC_NAMES,
    adjusted_cells,
    adjusted_header,
    adjusted_legend,
    delta_cell,
    escape,
    fmt,
    fmt_p,
    md_table,
    recall_text,
)


def load_runs(uri: str, run_ids: Sequence[str]) -> tuple[object, list[TrialRun]]:
    """The MLflow client and the runs, in the order given; a ReportError naming a run that is not there."""
    if len(run_ids) < 2:
        raise ReportError("compare needs at least two run ids (the first is the reference)")
    if len(set(run_ids)) != len(run_ids):
        raise ReportError("a run id is given twice")
    client = mlflow_client(uri)
    runs = []
    for run_id in run_ids:
        try:
            runs.append(trial_run(client.get_run(run_id)))
        except Exception as exc:  # noqa: BLE001 - MLflow raises its own types for a missing run
            raise ReportError(f"run '{run_id}' not found in {uri} ({type(exc).__name__})") from None
    return client, runs


def pick_split(runs: Sequence[TrialRun], split: str | None) -> str:
    """``split`` when some run logged it (else a ReportError naming the closest), else test when every run
    logged final test metrics, else val."""
    if split is not None:
        check_split(runs, split)
        return split
    return "test" if all(r.final("test", "sumr") is not None for r in runs) else "val"


def _label(run: TrialRun) -> str:
    name = run.params.get("name", "")
    shown = f" ({escape(name)})" if name and not run.name.startswith(name) else ""  # run names start with the config's
    return f"`{run.run_id[:8]}` {escape(run.name)}{shown}"


def compare_runs(
    uri: str, run_ids: Sequence[str], *, split: str | None = None, n_boot: int = 1000, seed: int = 0, adjust: str = "holm"
) -> str:
    """The markdown comparison of ``run_ids`` (the first is the reference) on ``split``."""
    if adjust not in stats.ADJUSTMENTS:
        raise ReportError(f"adjust must be one of {', '.join(stats.ADJUSTMENTS)}, got {adjust!r}")
    client, runs = load_runs(uri, run_ids)
    split = pick_split(runs, split)
    missing = [r.run_id for r in runs if r.final(split, "sumr") is None]
    if missing:
        raise ReportError(f"run '{missing[0]}' logged no final {split} metrics (final/{split}/sumr)")
    with tempfile.TemporaryDirectory(prefix="prvrlab-compare-") as cache:
        ranks = [run_ranks(client, r.run_id, split, Path(cache)) for r in runs]
    reference, ref_ranks = runs[0], ranks[0]
    ref_hits = None if ref_ranks is None else stats.hits(ref_ranks["rank"])  # (n, 4)
    rows, notes = [], []
    tested: dict[int, tuple[str, float]] = {}  # table row -> (run id, raw p)
    for i, (run, run_ranks_) in enumerate(zip(runs, ranks)):
        cells = [fmt(run.final(split, m)) for m in METRIC_KEYS]
        delta = p = DASH
        if i == 0:
            label = f"{_label(run)} (reference)"
        else:
            label = _label(run)
            if run_ranks_ is None or ref_ranks is None:
                notes.append(f"{_label(run if run_ranks_ is None else reference)} logged no ranks for {split}: no test.")
            else:
                try:
                    a, b = stats.align(run_ranks_["query_id"], stats.hits(run_ranks_["rank"]),
                                       ref_ranks["query_id"], ref_hits)
                except ValueError:
                    raise ReportError(f"runs '{run.run_id}' and '{reference.run_id}' ranked no common {split} query: "
                                      "they were evaluated on different collections") from None
                result = stats.paired_test(a, b, n_perm=n_boot, seed=seed)
                delta = delta_cell(result.delta, result.low, result.high)
                p = fmt_p(result.p_value)
                tested[len(rows)] = (run.run_id, result.p_value)
                shared = result.n_queries
                if shared != len(run_ranks_["rank"]) or shared != len(ref_ranks["rank"]):
                    notes.append(f"{_label(run)}: tested on the {shared} queries both runs ranked.")
        rows.append([label, *cells, delta, p, DASH, DASH])
    adjusted_cells(rows, tested, adjust, p_col=-2)
    header = ["Run", *(METRIC_NAMES[m] for m in METRIC_KEYS), "ΔSumR [95% CI]", "p (queries)", adjusted_header(adjust),
              "Significant"]
    out = [f"# Runs compared on {split}", "", md_table(header, rows).rstrip("\n"), ""]
    out.append(
        f"R@K in %, as logged (final/{split}/*). ΔSumR: the run minus the reference on the queries both ranked, "
        f"with a paired-bootstrap 95% interval; p (queries): two-sided sign-flip permutation test on the per-query "
        f"SumR differences ({n_boot} resamples, seed {seed}); "
        + adjusted_legend(adjust, len(tested), "comparisons with the reference")
        + f" Significant: p < {stats.ALPHA}."
    )
    published = {}
    for run in runs:
        row = run.published(split)
        if row is not None:
            published.setdefault(row[0], (row[1], []))[1].append(run)
    for source, (values, who) in published.items():
        shown = recall_text(values)
        deltas = "; ".join(f"{_label(r)} {fmt(r.final(split, 'sumr') - values['sumr'], signed=True)}"
                           for r in who if "sumr" in values)
        out.append("")
        out.append(f"Published ({escape(source)}, {split}): {shown}." + (f" SumR minus published: {deltas}." if deltas else ""))
    for note in notes:
        out += ["", note]
    return "\n".join(out) + "\n"
