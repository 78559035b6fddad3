"""The efficiency tables of ``prvrlab profile`` and ``prvrlab report --profile``, as the PRVR papers print them.

The measuring is :mod:`prvrlab.evaluation.profile` (it builds the model); the report takes it injected
(``Options.measure``), so the reports themselves read MLflow and artifacts only.
"""

from __future__ import annotations

from typing import Any, Sequence

from prvrlab.reports.tables import fmt, md_table


def profile_table(results: Sequence[Any]) -> str:
    """Two markdown tables: model cost (params, FLOPs, memory) and ms per query per gallery size.

    ``results``: :class:`prvrlab.evaluation.profile.ProfileResult` (or anything with its fields).
    """
    cost_rows = []
    for r in results:
        mem = fmt(r.index_mb, 2) + (f" (CUDA peak {fmt(r.cuda_peak_mb, 1)})" if r.cuda_peak_mb is not None else "")
        cost_rows.append([r.name, fmt(r.params / 1e6, 2), fmt(r.flops_pair / 1e9, 3), fmt(r.flops_query / 1e9, 3), mem])
    largest = max((max(r.ms_per_query) for r in results if r.ms_per_query), default=0)
    cost = md_table(
        ["Model", "Params (M)", "FLOPs (G)", f"Online FLOPs / query @ {largest:,} (G)", f"Memory @ {largest:,} (MB)"],
        cost_rows,
    )
    sizes = sorted({g for r in results for g in r.ms_per_query})
    speed = md_table(
        ["Database size", *(f"{g:,}" for g in sizes)],
        [[r.name, *(fmt(r.ms_per_query.get(g), 2) for g in sizes)] for r in results],
    )
    devices = ", ".join(sorted({r.device for r in results}))
    threads = " / ".join(str(t) for t in sorted({r.threads for r in results}))
    return f"{cost}\nRuntime (ms per query, median; {devices}, {threads} threads):\n\n{speed}"
