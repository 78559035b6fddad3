"""Helpers shared by the report tests."""

from __future__ import annotations


def md_rows(md: str, heading: str) -> list[list[str]]:
    """Rows (cells stripped of bold) of the first table after a heading starting with ``heading``."""
    lines = md.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(heading))
    rows = []
    for ln in lines[start + 1 :]:
        if ln.startswith("|"):
            rows.append([c.strip().replace("**", "") for c in ln.strip("|").split("|")])
        elif rows:
            break
    return rows


def fake_run(variant: str, seed: int, ranks, *, split: str = "test", status: str = "finished"):
    """A child run of an ablation whose final metrics are the recall of ``ranks`` (what training logs)."""
    import numpy as np

    from prvrlab.reports.source import TrialRun

    r = np.asarray(ranks)
    recall = {f"r{k}": float(np.mean(r <= k) * 100.0) for k in (1, 5, 10, 100)}
    metrics = {f"final/{split}/{m}": v for m, v in {**recall, "sumr": sum(recall.values())}.items()}
    tags = {"prvrlab.variant": variant, "prvrlab.seed": str(seed), "prvrlab.status": status}
    run_id = f"{variant}-seed{seed}"
    return TrialRun(run_id, run_id, "FINISHED" if status == "finished" else "FAILED", 0, tags, {}, metrics)


def fake_study(runs, ranks: dict, *, baseline: str, seeds: list[int], kind: str = "ablation"):
    """A study held in memory: ``ranks`` maps a run id to the ranks it logged (a run not in it logged none)."""
    import numpy as np

    from prvrlab.reports.source import Study

    class InMemory(Study):
        def ranks(self, run, split):
            r = ranks.get(run.run_id)
            return None if r is None else {"query_id": np.array([f"q{i:04d}" for i in range(len(r))]), "rank": np.asarray(r)}

        def distributions(self, run):
            return {}

        def history(self, run, key):
            return []

    variants = {v: {} for v in dict.fromkeys(r.variant for r in runs)}
    return InMemory("memory", "parent", kind, "demo", "0", {}, {}, {"variants": variants, "baseline": baseline, "seeds": seeds}, runs)


def sumr_per_query(ranks):
    """Per-query SumR contribution: 100 for each K in (1, 5, 10, 100) the rank is within."""
    import numpy as np

    return np.array([sum(100.0 for k in (1, 5, 10, 100) if r <= k) for r in ranks])
