"""``prvrlab compare``: three real tiny training runs, the table checked against MLflow and a direct test."""

from __future__ import annotations

import pytest
import yaml

from prvrlab.evaluation.metrics import load_ranks
from prvrlab.platform.cli import EXIT_BAD_INPUT, main
from prvrlab.platform.tracking.store import Tracker
from prvrlab.reports import stats
from prvrlab.reports.compare import compare_runs

from report_helpers import md_rows
from train_helpers import small_raw

N_BOOT = 200
METRICS = ("r1", "r5", "r10", "r100", "sumr")


@pytest.fixture(scope="module")
def three_runs(tiny_root, tmp_path_factory):
    """Three 1-epoch runs (seeds 0, 1 and lr x3 for the third), the first with a published row on val."""
    tmp = tmp_path_factory.mktemp("compare")
    ids = []
    for i, train in enumerate(({"seed": 0}, {"seed": 1}, {"seed": 0, "lr": 3e-3})):
        raw = small_raw(tiny_root, tmp, epochs=1, **train)
        raw["name"] = f"cfg{i}"
        if i == 0:
            raw["published"] = {"source": "Table X", "split": "val", "r1": 1.0, "r5": 2.0, "r10": 3.0, "r100": 50.0, "sumr": 56.0}
        path = tmp / f"c{i}.yaml"
        path.write_text(yaml.safe_dump(raw))
        assert main(["train", str(path), "--no-ray"]) == 0
        tracker = Tracker(raw["tracking"]["uri"], "tests")
        (latest,) = tracker.client.search_runs([tracker.experiment_id], order_by=["attributes.start_time DESC"], max_results=1)
        ids.append(latest.info.run_id)
    return {"uri": raw["tracking"]["uri"], "ids": ids, "tracker": tracker, "results": tmp / "results"}


def _ranks(three_runs, run_id: str, split: str):
    run = three_runs["tracker"].client.get_run(run_id)
    (path,) = three_runs["results"].glob(f"{run.info.run_name}/files/ranks_{split}.parquet")
    table = load_ranks(path)
    return [str(q) for q in table.column("query_id").to_pylist()], stats.hits(table.column("rank").to_numpy())


def test_the_table_is_mlflow_plus_paired_tests_against_the_first_run(three_runs):
    uri, ids = three_runs["uri"], three_runs["ids"]
    md = compare_runs(uri, ids, split="val", n_boot=N_BOOT, seed=0)
    rows = md_rows(md, "# Runs compared on val")
    assert rows[0] == ["Run", "R@1", "R@5", "R@10", "R@100", "SumR", "ΔSumR [95% CI]", "p (queries)", "p (Holm)", "Significant"]
    body = rows[2:]
    assert len(body) == 3 and body[0][0].endswith("(reference)") and body[0][6:] == ["—", "—", "—", "—"]
    client = three_runs["tracker"].client
    for row, run_id in zip(body, ids):
        metrics = client.get_run(run_id).data.metrics
        assert row[0].startswith(f"`{run_id[:8]}`")
        assert row[1:6] == [f"{metrics[f'final/val/{m}']:.1f}" for m in METRICS]
    ref_ids, ref_hits = _ranks(three_runs, ids[0], "val")
    expected = []
    for run_id in ids[1:]:
        q, h = _ranks(three_runs, run_id, "val")
        a, b = stats.align(q, h, ref_ids, ref_hits)
        expected.append(stats.paired_test(a, b, n_perm=N_BOOT, seed=0))
    holm = stats.holm([r.p_value for r in expected])
    for row, result, p_adj in zip(body[1:], expected, holm):
        sign = lambda x: f"{x:+.1f}" if f"{abs(x):.1f}" != "0.0" else "0.0"  # noqa: E731
        assert row[6] == f"{sign(result.delta)} [{sign(result.low)}, {sign(result.high)}]"
        assert row[7] == (f"{result.p_value:.3f}" if result.p_value >= 0.001 else "<0.001")
        assert row[8] == (f"{p_adj:.3f}" if p_adj >= 0.001 else "<0.001")
        assert row[9] == ("yes" if p_adj < 0.05 else "no †")
    ref_sumr = client.get_run(ids[0]).data.metrics["final/val/sumr"]
    assert "Published (Table X, val): R@1 1.0  R@5 2.0  R@10 3.0  R@100 50.0  SumR 56.0." in md
    assert f"SumR minus published: `{ids[0][:8]}`" in md and f"{ref_sumr - 56.0:+.1f}." in md


def test_the_split_defaults_to_test_when_every_run_has_it_and_a_run_without_ranks_is_not_tested(three_runs, tmp_path):
    uri, ids = three_runs["uri"], three_runs["ids"]
    assert "# Runs compared on test" in compare_runs(uri, ids[:2], n_boot=20)
    tracker = three_runs["tracker"]
    bare = tracker.start_run("bare", tags={})
    tracker.log_metrics(bare, {f"final/val/{m}": 1.0 for m in METRICS})
    tracker.end_run(bare, "FINISHED")
    md = compare_runs(uri, [ids[0], bare], split="val", n_boot=20)
    assert f"`{bare[:8]}` bare logged no ranks for val: no test." in md


def test_runs_of_different_collections_are_refused(three_runs, tmp_path):
    """A run whose ranks share no query id with the reference's (another collection) is one clear error."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from prvrlab.reports.errors import ReportError

    tracker = three_runs["tracker"]
    other = tracker.start_run("other", tags={})
    tracker.log_metrics(other, {f"final/val/{m}": 1.0 for m in METRICS})
    ranks = tmp_path / "ranks_val.parquet"
    pq.write_table(pa.table({"query_id": ["elsewhere#0"], "video_id": ["v"], "rank": [1]}), ranks)
    tracker.log_artifacts(other, [ranks], "ranks")
    tracker.end_run(other, "FINISHED")
    with pytest.raises(ReportError, match=f"runs '{other}' and '{three_runs['ids'][0]}' ranked no common val query"):
        compare_runs(three_runs["uri"], [three_runs["ids"][0], other], split="val", n_boot=20)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["0123456789abcdef0123456789abcdef"], "compare needs at least two run ids"),
        (["RUN0", "RUN0"], "a run id is given twice"),
        (["RUN0", "0123456789abcdef0123456789abcdef"], "run '0123456789abcdef0123456789abcdef' not found"),
        (["RUN0", "RUN1", "--split", "train"], "logged no final train metrics"),
    ],
)
def test_bad_input_exits_2_with_one_line(three_runs, args, message, capsys):
    args = [three_runs["ids"][int(a[3:])] if a.startswith("RUN") else a for a in args]
    assert main(["compare", *args, "--tracking-uri", three_runs["uri"]]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_cli_prints_and_writes_the_table(three_runs, tmp_path, capsys):
    out = tmp_path / "cmp" / "compare.md"
    ids = three_runs["ids"]
    assert main(["compare", *ids, "--tracking-uri", three_runs["uri"], "--split", "val", "--bootstrap", "50",
                 "--adjust", "none", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed == out.read_text() == compare_runs(three_runs["uri"], ids, split="val", n_boot=50, adjust="none")
    assert "p (unadjusted)" in printed


def test_the_tracking_store_defaults_to_mlflow_tracking_uri(three_runs, monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)  # no ./mlflow.db here: the runs are found through the variable
    monkeypatch.setenv("MLFLOW_TRACKING_URI", three_runs["uri"])
    assert main(["compare", *three_runs["ids"][:2], "--split", "val", "--bootstrap", "20"]) == 0
    assert f"`{three_runs['ids'][1][:8]}`" in capsys.readouterr().out


def test_a_reference_without_ranks_is_named_once_and_no_adjustment_is_claimed(monkeypatch):
    import numpy as np

    from prvrlab.reports import compare
    from prvrlab.reports.source import TrialRun

    def run(i: int) -> TrialRun:
        metrics = {f"final/test/{m}": v for m, v in (("r1", 10.0), ("r5", 20.0), ("r10", 30.0), ("r100", 60.0), ("sumr", 120.0 + i))}
        return TrialRun(f"run{i}aaaaaaaa", f"run {i}", "FINISHED", 0, {}, {"data.collection": "synth"}, metrics)

    runs = [run(0), run(1), run(2)]
    rng = np.random.default_rng(0)
    ranks = {"run0aaaaaaaa": None, "run1aaaaaaaa": None,
             "run2aaaaaaaa": {"query_id": np.array([f"q{i}" for i in range(40)]), "rank": rng.integers(1, 50, 40)}}
    monkeypatch.setattr(compare, "load_runs", lambda uri, ids: (None, runs, [[], [], []]))
    monkeypatch.setattr(compare, "run_ranks", lambda client, run_id, split, cache: ranks[run_id])
    text = compare_runs("sqlite:///unused.db", [r.run_id for r in runs], n_boot=50)
    notes = [ln for ln in text.splitlines() if "logged no ranks" in ln]
    assert notes == ["`run0aaaa` run 0 logged no ranks for test: no test.", "`run1aaaa` run 1 logged no ranks for test: no test."]
    assert "0 comparisons" not in text
    assert "p (Holm): none of the table's comparisons with the reference was tested over queries, so none adjusted." in text


def test_the_delta_is_the_sumr_difference_counted_by_hand_from_the_ranks(three_runs):
    """ΔSumR's point estimate, recomputed without the statistics module: on the queries both runs ranked,
    100 x the share with rank <= K, summed over K in (1, 5, 10, 100), the run's minus the reference's."""
    import numpy as np

    uri, ids = three_runs["uri"], three_runs["ids"]
    body = md_rows(compare_runs(uri, ids, split="val", n_boot=N_BOOT, seed=0), "# Runs compared on val")[2:]

    def ranks(run_id):
        run = three_runs["tracker"].client.get_run(run_id)
        (path,) = three_runs["results"].glob(f"{run.info.run_name}/files/ranks_val.parquet")
        table = load_ranks(path)
        return dict(zip((str(q) for q in table.column("query_id").to_pylist()), table.column("rank").to_numpy()))

    def sumr(by_query, queries):
        r = np.array([by_query[q] for q in queries])
        return sum(100.0 * float(np.mean(r <= k)) for k in (1, 5, 10, 100))

    reference = ranks(ids[0])
    for row, run_id in zip(body[1:], ids[1:]):
        other = ranks(run_id)
        common = sorted(set(reference) & set(other))
        assert len(common) == len(reference)  # one split, every query ranked by both
        delta = sumr(other, common) - sumr(reference, common)
        shown = row[6].split(" [")[0]
        assert shown == (f"{delta:+.1f}" if f"{abs(delta):.1f}" != "0.0" else "0.0")
