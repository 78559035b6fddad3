"""``prvrlab compare`` refuses runs evaluated on other data and bad ranks artifacts: fake MLflow runs, no training."""

from __future__ import annotations

import numpy as np
import pytest

from prvrlab.evaluation.metrics import rank_table, save_ranks
from prvrlab.platform.cli import EXIT_BAD_INPUT, main
from prvrlab.platform.tracking.datasets import CollectionDataset
from prvrlab.platform.tracking.store import Tracker
from prvrlab.reports.compare import compare_runs
from prvrlab.reports.errors import ReportError

from report_helpers import md_rows

QUERIES = [f"synth_test_{i // 2:05d}#{i % 2}" for i in range(40)]  # the same ids for every synthetic seed
VIDEOS = [q.split("#")[0] for q in QUERIES]
DATA = {"data.collection": "synth", "data.visual_feature": "synth_feat", "data.text_feature": "None",
        "data.train_split": "train", "data.val_split": "val", "data.test_split": "test", "data.synthesize": "tiny"}


def _profile(test_queries: int = 40, test_videos: int = 20) -> dict:
    return {"splits": {"train": {"queries": 80, "videos": 40}, "val": {"queries": 40, "videos": 20},
                       "test": {"queries": test_queries, "videos": test_videos}},
            "visual_feature": "synth_feat", "video_dim": 64, "query_dim": 48, "videos_in_store": 80}


@pytest.fixture()
def store(tmp_path):
    """A function making a finished run in a fresh SQLite store: data params, dataset input, final test
    metrics, ranks artifact; returns its id."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker(uri, "tests")
    made = [0]

    def make(*, params=DATA, digest="aaaaaaaaaaaa", profile=None, root="/data/a", ranks=None, videos=VIDEOS,
             extra_metrics=None, artifact=None):
        made[0] += 1
        run_id = tracker.start_run(f"run{made[0]}", tags={})
        if params:
            tracker.log_params(run_id, {**params, "data.root": root, "model.name": f"m{made[0]}"})
        if digest:
            tracker.log_dataset(run_id, CollectionDataset(root=root, name="synth", digest=digest,
                                                          profile=profile or _profile()))
        r = np.asarray(ranks if ranks is not None else (np.arange(len(QUERIES)) % 7) + made[0])
        recall = {f"r{k}": float(np.mean(r <= k) * 100) for k in (1, 5, 10, 100)}
        tracker.log_metrics(run_id, {f"final/test/{m}": v for m, v in {**recall, "sumr": sum(recall.values())}.items()})
        tracker.log_metrics(run_id, {**(extra_metrics or {})})
        folder = tmp_path / run_id
        if artifact is None:
            path = save_ranks(folder / "ranks_test.parquet", rank_table(QUERIES, videos, r))
        else:
            folder.mkdir()
            path = folder / "ranks_test.parquet"
            artifact(path)
        tracker.log_artifacts(run_id, [path], "ranks")
        tracker.end_run(run_id, "FINISHED")
        return run_id

    make.uri = uri
    return make


def _cli(store, ids, capsys, *extra):
    code = main(["compare", *ids, "--tracking-uri", store.uri, "--bootstrap", "20", *extra])
    return code, capsys.readouterr()


def test_runs_of_the_same_data_with_other_models_and_roots_compare(store, capsys):
    a, b = store(root="/machine1/synth"), store(root="/machine2/synth")
    code, out = _cli(store, [a, b], capsys)
    assert code == 0 and out.err == ""
    rows = md_rows(out.out, "# Runs compared on test")
    assert rows[3][7] not in ("", "—") and "not checked" not in out.out
    assert compare_runs(f"{store.uri}?timeout=20", [a, b], n_boot=20) == compare_runs(store.uri, [a, b], n_boot=20)


def test_compare_out_writes_the_printed_table(store, capsys, tmp_path):
    a, b = store(root="/machine1/synth"), store(root="/machine2/synth")
    out_file = tmp_path / "tables" / "compare.md"
    code, out = _cli(store, [a, b], capsys, "--out", str(out_file))
    assert code == 0 and out_file.read_text() == out.out
    assert [p.name for p in out_file.parent.iterdir()] == ["compare.md"]  # no temporary left beside it


@pytest.mark.parametrize(
    ("other", "differs"),
    [
        ({"digest": "bbbbbbbbbbbb"}, "dataset digest aaaaaaaaaaaa vs bbbbbbbbbbbb"),  # another synth seed, same sizes
        ({"digest": "bbbbbbbbbbbb", "profile": _profile(36)}, "the test split has 40 queries and 20 videos vs 36 and 20"),
        ({"params": {**DATA, "data.collection": "synth2"}}, "data.collection is 'synth' vs 'synth2'"),
        ({"params": {**DATA, "data.test_split": "test_small"}}, "data.test_split is 'test' vs 'test_small'"),
    ],
)
def test_runs_evaluated_on_other_data_are_refused(store, capsys, other, differs):
    a, b = store(), store(**other)
    code, out = _cli(store, [a, b], capsys)
    assert code == EXIT_BAD_INPUT and out.out == ""
    assert out.err.startswith(f"prvrlab: error: runs '{a}' and '{b}' were evaluated on different data: {differs}")
    assert out.err.count("\n") == 1


def test_another_visual_feature_on_the_same_queries_compares(store, capsys):
    """The digest covers the feature store too: with another data.visual_feature it may differ while the
    evaluated queries are the same (a feature ablation)."""
    a = store()
    b = store(params={**DATA, "data.visual_feature": "clip_feat"}, digest="cccccccccccc")
    code, out = _cli(store, [a, b], capsys)
    assert code == 0 and md_rows(out.out, "# Runs compared on test")[3][7] != "—"


def test_runs_without_data_identity_compare_with_a_note(store, capsys):
    a, b = store(), store(params={}, digest=None)
    code, out = _cli(store, [a, b], capsys)
    assert code == 0
    assert "recorded no data params and no dataset input: that it was evaluated on the same data" in out.out
    assert f"`{b[:8]}`" in out.out.split("recorded no data params")[0].splitlines()[-1]


def test_a_shared_query_with_another_ground_truth_video_is_refused(store, capsys):
    videos = list(VIDEOS)
    videos[5] = "synth_test_09999"
    a, b = store(params={}, digest=None), store(params={}, digest=None, videos=videos)
    code, out = _cli(store, [a, b], capsys)
    assert code == EXIT_BAD_INPUT and out.err.count("\n") == 1
    assert (f"runs '{a}' and '{b}' were evaluated on different data: test query '{QUERIES[5]}' has ground-truth "
            f"video '{VIDEOS[5]}' vs 'synth_test_09999'") in out.err


def _garbage(path):
    path.write_bytes(b"this is no parquet file\n" * 10)


def _no_query_id(path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"qid": ["q"], "rank": [1]}), path)


def _text_ranks(path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"query_id": QUERIES, "rank": ["first"] * len(QUERIES)}), path)


def _repeated_query(path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"query_id": [*QUERIES, QUERIES[2]], "rank": [1] * (len(QUERIES) + 1)}), path)


def _rank_zero(path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"query_id": QUERIES, "rank": [0] + [1] * (len(QUERIES) - 1)}), path)


@pytest.mark.parametrize(
    ("artifact", "reason"),
    [(_garbage, "cannot be read as a ranks table"), (_no_query_id, "is not a ranks table: no column query_id"),
     (_text_ranks, "is not a ranks table"), (_repeated_query, f"ranks query '{QUERIES[2]}' more than once"),
     (_rank_zero, "holds rank 0; ranks start at 1")],
)
def test_a_corrupt_or_foreign_ranks_artifact_is_one_line(store, capsys, artifact, reason):
    a, b = store(), store(artifact=artifact)
    code, out = _cli(store, [a, b], capsys)
    assert code == EXIT_BAD_INPUT and out.out == "" and out.err.count("\n") == 1
    assert f"run '{b}': artifact ranks/ranks_test.parquet {reason}" in out.err


def test_best_is_no_split(store, capsys):
    """final/best/sumr (the best validation SumR) is logged beside final/test/*: best is no evaluated split."""
    best = {"final/best/sumr": 200.0, "final/best/epoch": 3.0}
    a, b = store(extra_metrics=best), store(extra_metrics=best)
    code, out = _cli(store, [a, b], capsys, "--split", "best")
    assert code == EXIT_BAD_INPUT and out.out == "" and out.err.count("\n") == 1
    logged = out.err.split("splits they logged: ")[1].split(" (")[0].strip()
    assert "split 'best'" in out.err and logged == "test"
    with pytest.raises(ReportError, match="splits they logged: test"):
        compare_runs(store.uri, [a, b], split="best", n_boot=20)


@pytest.mark.parametrize("command", ["compare", "report"])
def test_a_missing_sqlite_store_is_refused_and_not_created(tmp_path, capsys, command):
    db = tmp_path / "nonexist.db"
    ids = ["0123456789abcdef0123456789abcdef", "fedcba9876543210fedcba9876543210"]
    args = ids if command == "compare" else ["--run-id", ids[0]]
    assert main([command, *args, "--tracking-uri", f"sqlite:///{db}"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(db) in err and "does not exist" in err
    assert not db.exists() and list(tmp_path.iterdir()) == []
