"""rank_table's own length check, not pyarrow's error for columns of different lengths."""

from __future__ import annotations

import pytest

from prvrlab.evaluation import metrics as evm


@pytest.mark.parametrize(
    "queries, videos, ranks",
    [(["q0", "q1"], ["v0"], [1, 2]), (["q0", "q1"], ["v0", "v1"], [1]), (["q0"], ["v0"], [[1]])],
)
def test_lists_of_different_lengths_are_refused_by_name(queries, videos, ranks):
    with pytest.raises(ValueError, match=r"query_ids \(\d+\), video_ids_of_queries \(\d+\) and ranks .* must have the same length"):
        evm.rank_table(queries, videos, ranks)
