"""``prvrlab compare``: any training runs side by side on one split, with query-level significance.

The first run is the reference.  Each row shows a run's final R@K and SumR as logged
(``final/<split>/*``); every other run's ΔSumR against the reference comes with a paired-bootstrap
95% interval and a two-sided sign-flip test over the queries both runs ranked (their
``ranks/ranks_<split>.parquet`` artifacts, :mod:`prvrlab.reports.stats`), p-values adjusted over the
table's comparisons (Holm by default).  A run's config ``published`` row on the split is shown too.
No study is needed: the runs may come from ``prvrlab train``, a search or an ablation.  Runs evaluated on
other data (:func:`data_difference`, or a shared query with another ground-truth video) are refused: their
query ids can be the same (a synthetic collection of another seed) while the queries are not.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Sequence

from prvrlab.checks import first_line
from prvrlab.evaluation.metrics import METRIC_KEYS
from prvrlab.reports import stats
from prvrlab.reports.errors import ReportError
from prvrlab.reports.source import (
    TrialRun,
    check_split,
    evaluated_splits,
    ground_truth_difference,
    mlflow_client,
    run_ranks,
    trial_run,
)
from prvrlab.reports.tables import (
    DASH,
    METRIC_NAMES,
    NOT_SIGNIFICANT,
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


def load_runs(uri: str, run_ids: Sequence[str]) -> tuple[object, list[TrialRun], list[list[dict]]]:
    """The MLflow client, the runs in the order given and each run's dataset inputs (:func:`datasets_of`);
    a ReportError naming a run that is not there."""
    if len(run_ids) < 2:
        raise ReportError("compare needs at least two run ids (the first is the reference)")
    if len(set(run_ids)) != len(run_ids):
        raise ReportError("a run id is given twice")
    client = mlflow_client(uri, existing=True)
    runs, datasets = [], []
    for run_id in run_ids:
        try:
            entity = client.get_run(run_id)
        except Exception as exc:  # noqa: BLE001 - MLflow raises its own types for a missing run
            missing = getattr(exc, "error_code", "") == "RESOURCE_DOES_NOT_EXIST" or "not found" in str(exc).lower()
            why = "" if missing else f" ({first_line(exc)})"
            raise ReportError(f"run '{run_id}' {'not found in' if missing else 'cannot be read from'} {uri}{why}") from None
        runs.append(trial_run(entity))
        datasets.append(datasets_of(entity))
    return client, runs, datasets


def datasets_of(entity) -> list[dict]:
    """``{"name", "digest", "profile"}`` of each MLflow dataset input of a run entity that has a digest
    (training logs its collection, :mod:`prvrlab.platform.tracking.datasets`); a profile that is no JSON
    object is {}."""
    out = []
    for item in getattr(getattr(entity, "inputs", None), "dataset_inputs", None) or []:
        dataset = item.dataset
        if not dataset.digest:
            continue
        try:
            profile = json.loads(dataset.profile or "{}")
        except ValueError:
            profile = {}
        out.append({"name": dataset.name, "digest": dataset.digest, "profile": profile if isinstance(profile, dict) else {}})
    return out


# data params that decide which files the dataset digest covers: when a pair of runs agrees on all of
# them, different digests mean different file contents (another synthetic seed, another release)
DIGEST_PARAMS = ("data.collection", "data.visual_feature", "data.text_feature", "data.train_split", "data.val_split",
                 "data.test_split")


def _split_size(run: TrialRun, datasets: list[dict], split: str) -> tuple[int, int] | None:
    """(queries, videos) of the evaluated ``split`` in the run's dataset profile, None when not recorded."""
    name = run.params.get(f"data.{split}_split", split)
    for dataset in datasets:
        size = dataset["profile"].get("splits", {}).get(name)
        if isinstance(size, dict) and "queries" in size and "videos" in size:
            return int(size["queries"]), int(size["videos"])
    return None


def data_difference(a: TrialRun, a_sets: list[dict], b: TrialRun, b_sets: list[dict], split: str) -> str | None:
    """What differs between the data the two runs were evaluated on (on ``split``), None when nothing
    recorded differs.

    Refused: another collection (data.collection), another split of it (data.<split>_split), another size of
    the evaluated split (dataset profile), or other dataset digests while the data params the digest depends
    on are the same.  Other digests with another visual or text feature, or other training split, are not
    refused: the evaluated queries and their ground truth can be the same (a feature ablation).  data.root
    is not compared: the same collection lives in other folders on other machines."""
    for key in ("data.collection", f"data.{split}_split"):
        x, y = a.params.get(key), b.params.get(key)
        if x is not None and y is not None and x != y:
            return f"{key} is '{x}' vs '{y}'"
    sa, sb = _split_size(a, a_sets, split), _split_size(b, b_sets, split)
    if sa is not None and sb is not None and sa != sb:
        return f"the {split} split has {sa[0]} queries and {sa[1]} videos vs {sb[0]} and {sb[1]} (dataset profile)"
    da, db = {d["digest"] for d in a_sets}, {d["digest"] for d in b_sets}
    same_params = all(a.params.get(k) == b.params.get(k) for k in DIGEST_PARAMS)
    if da and db and not da & db and same_params:
        return f"dataset digest {', '.join(sorted(da))} vs {', '.join(sorted(db))} with the same data params (other file contents)"
    return None


def _unrecorded(run: TrialRun, datasets: list[dict]) -> str | None:
    """What the run does not record of its data identity and what is left unchecked (None: it records both
    its data params and a dataset digest)."""
    if "data.collection" not in run.params:
        return ("no data params and no dataset input: that it was evaluated on the same data as the others is not "
                "checked" if not datasets else "no data params: only its dataset's digest and split sizes are checked")
    return None if datasets else "no dataset input (digest): only its collection and split names are checked"


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


def _check_ground_truth(run: TrialRun, ranks: dict, reference: TrialRun, ref_ranks: dict, split: str) -> None:
    """A ReportError when a query both ranks tables hold has another ground-truth video in each (tables
    without ``video_id`` are not checked)."""
    differs = ground_truth_difference(ranks, ref_ranks)
    if differs is not None:
        query, video, ref_video = differs
        raise ReportError(
            f"runs '{reference.run_id}' and '{run.run_id}' were evaluated on different data: {split} query "
            f"'{query}' has ground-truth video '{ref_video}' vs '{video}' (ranks/ranks_{split}.parquet)"
        )


def compare_runs(
    uri: str, run_ids: Sequence[str], *, split: str | None = None, n_boot: int = 1000, seed: int = 0, adjust: str = "holm"
) -> str:
    """The markdown comparison of ``run_ids`` (the first is the reference) on ``split``."""
    if adjust not in stats.ADJUSTMENTS:
        raise ReportError(f"adjust must be one of {', '.join(stats.ADJUSTMENTS)}, got {adjust!r}")
    client, runs, datasets = load_runs(uri, run_ids)
    split = pick_split(runs, split)
    missing = [r for r in runs if r.final(split, "sumr") is None]
    if missing:
        kind = missing[0].tags.get("prvrlab.kind")
        if kind in ("search", "ablation"):  # a study's parent run: its children are the runs to compare
            raise ReportError(f"run '{missing[0].run_id}' is the parent run of a {kind}, not a training run; compare its "
                              f"trials' runs, or write its report: prvrlab report --run-id {missing[0].run_id}")
        own = evaluated_splits(missing[:1])
        common = sorted(set.intersection(*(set(evaluated_splits([r])) for r in runs)))
        run = missing[0]
        ended = "" if run.ok else (" (it is still RUNNING)" if run.run_status == "RUNNING"
                                   else f" (it ended {run.run_status}, status {run.status})")
        raise ReportError(
            f"run '{missing[0].run_id}'{ended} logged no final {split} metrics (final/{split}/sumr); it logged: "
            f"{', '.join(own) or 'none'}" + (f"; splits every run logged: {', '.join(common)} (--split)" if common else "")
        )
    notes = []
    for run, sets in zip(runs[1:], datasets[1:]):
        differs = data_difference(runs[0], datasets[0], run, sets, split)
        if differs:
            raise ReportError(f"runs '{runs[0].run_id}' and '{run.run_id}' were evaluated on different data: {differs}")
    for run, sets in zip(runs, datasets):
        unknown = _unrecorded(run, sets)
        if unknown:
            notes.append(f"{_label(run)} recorded {unknown}.")
    with tempfile.TemporaryDirectory(prefix="prvrlab-compare-") as cache:
        ranks = [run_ranks(client, r.run_id, split, Path(cache)) for r in runs]
    reference, ref_ranks = runs[0], ranks[0]
    notes += [f"{_label(r)} logged no ranks for {split}: no test." for r, x in zip(runs, ranks) if x is None and len(runs) > 1]
    ref_hits = None if ref_ranks is None else stats.hits(ref_ranks["rank"])  # (n, 4)
    rows = []
    tested: dict[int, tuple[str, float]] = {}  # table row -> (run id, raw p)
    for i, (run, run_ranks_) in enumerate(zip(runs, ranks)):
        cells = [fmt(run.final(split, m)) for m in METRIC_KEYS]
        delta = p = DASH
        if i == 0:
            label = f"{_label(run)} (reference)"
        else:
            label = _label(run)
            if run_ranks_ is not None and ref_ranks is not None:  # else no test (noted above)
                try:
                    a, b = stats.align(run_ranks_["query_id"], stats.hits(run_ranks_["rank"]),
                                       ref_ranks["query_id"], ref_hits)
                except stats.NoSharedQueries:
                    raise ReportError(f"runs '{run.run_id}' and '{reference.run_id}' ranked no common {split} query: "
                                      "they were evaluated on different collections") from None
                _check_ground_truth(run, run_ranks_, reference, ref_ranks, split)
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
        + adjusted_legend(adjust, len(tested), "comparisons with the reference", n_boot)
        + f" Significant: {adjusted_header(adjust)} < {stats.ALPHA}; {NOT_SIGNIFICANT} = not significant."
    )
    published = {}
    for run in runs:
        row = run.published(split)
        if row is not None:
            published.setdefault(row[0], (row[1], []))[1].append(run)
        elif (elsewhere := run.published_elsewhere(split)) is not None:
            notes.append(f"{_label(run)}: {escape(elsewhere)}")
    for source, (values, who) in published.items():
        shown = recall_text(values)
        deltas = "; ".join(f"{_label(r)} {fmt(r.final(split, 'sumr') - values['sumr'], signed=True)}"
                           for r in who if "sumr" in values)
        out.append("")
        out.append(f"Published ({escape(source)}, {split}): {shown}." + (f" SumR minus published: {deltas}." if deltas else ""))
    for note in notes:
        out += ["", note]
    return "\n".join(out) + "\n"
