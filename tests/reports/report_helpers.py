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


def search_trial(i: int, params: dict, metrics: dict, *, status: str = "finished"):
    """Trial ``t<i>`` of a search: ``params`` logged as MLflow logs them (``str`` of the value), ``metrics`` as given."""
    from prvrlab.reports.source import TrialRun

    tags = {"prvrlab.status": status, "prvrlab.trial_id": f"t{i:02d}", "prvrlab.epoch_base": "1"}
    return TrialRun(f"run{i:02d}", f"trial {i}", "FINISHED", i, tags, {k: str(v) for k, v in params.items()}, metrics)


def fake_search(runs, space: dict, *, metric: str = "val/sumr", mode: str = "max", history: dict | None = None):
    """A search held in memory with the spec's ``space``; ``history`` maps (run id, metric) to its per-epoch
    [(epoch, value)] (a pair not in it logged none); no run logged ranks."""
    from prvrlab.reports.source import Study

    class InMemory(Study):
        def ranks(self, run, split):
            return None

        def distributions(self, run):
            return {}

        def history(self, run, key):
            return list((history or {}).get((run.run_id, key), []))

    params = {"spec.metric": metric, "spec.mode": mode}
    return InMemory("memory", "parent", "search", "demo", "0", {}, params, {"space": space}, runs)
