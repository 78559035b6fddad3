"""A ranks artifact with null query ids or ranks is one error naming the column, not a numpy warning and a rank
of -9223372036854775808."""

from __future__ import annotations

import warnings

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prvrlab.reports.errors import ReportError
from prvrlab.reports.source import run_cache, run_ranks


@pytest.mark.parametrize("column, values", [("rank", [1, None, 3]), ("query_id", ["q0", None, "q2"])])
def test_null_values_are_named(tmp_path, column, values):
    table = {"query_id": ["q0", "q1", "q2"], "rank": [1, 2, 3], column: values}
    folder = run_cache(tmp_path, "run1") / "ranks"
    folder.mkdir(parents=True)
    pq.write_table(pa.table(table), folder / "ranks_test.parquet")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ReportError) as caught:
            run_ranks(None, "run1", "test", tmp_path)
    assert str(caught.value) == (f"run 'run1': artifact ranks/ranks_test.parquet is not a ranks table: column {column} "
                                 "holds 1 null value(s)")


def test_a_whole_table_reads(tmp_path):
    folder = run_cache(tmp_path, "run1") / "ranks"
    folder.mkdir(parents=True)
    pq.write_table(pa.table({"query_id": ["q1", "q0"], "rank": [2, 1]}), folder / "ranks_test.parquet")
    out = run_ranks(None, "run1", "test", tmp_path)
    assert list(out["query_id"]) == ["q0", "q1"] and list(out["rank"]) == [1, 2]
