"""A tiny search on one simulated Ray node, on two, and on two losing one mid-search.

Nodes are ``ray.cluster_utils.Cluster`` nodes of this machine (127.0.0.1,
``--node-cpus`` logical CPUs each).  Trials have 2 DDP workers at 1 CPU
(2.01 CPUs with the trial actor), concurrency 2: one node of 3 CPUs holds one
trial at a time, two hold two.  Prints, per layout, the wall time and the
trials placed per node (the node of each trial's rank 0, all attempts), and
for the node loss: when the cluster noticed, when the interrupted trial said
why it waits, when it was placed again (recovery) and when the search ended,
all from the kill.  Logical CPUs are not cores: on a machine with fewer
cores than CPUs asked, two nodes cannot halve the wall time.

    .venv/bin/python benchmarks/bench_cluster.py [--trials 4] [--epochs 2] [--node-cpus 3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "platform"))  # the simulated cluster and spec helpers of the tests

from cluster_helpers import simulated_cluster, trial_nodes  # noqa: E402
from search_helpers import tiny_spec  # noqa: E402

from prvrlab.data.synth import synthesize  # noqa: E402
from prvrlab.platform.search.spec import load_search_spec  # noqa: E402
from prvrlab.platform.search.tuning import search  # noqa: E402


def run(tmp: Path, root: Path, name: str, args, extra_nodes: int, kill: bool) -> dict:
    """One search on a head and ``extra_nodes`` worker nodes; ``kill``: lose one worker node mid-search."""
    tmp.mkdir(parents=True, exist_ok=True)
    path = tiny_spec(
        tmp, root, name=name, budget={"trials": args.trials}, concurrency=2, max_retries=3,
        resources={"workers_per_trial": 2, "cpus_per_worker": 1, "placement_timeout_s": 60},
    )  # fmt: skip
    raw = yaml.safe_load(path.read_text())
    raw["overrides"]["train.epochs"] = args.epochs
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    spec = load_search_spec(path)
    lines: list[tuple[float, str]] = []
    results = tmp / "results"
    events: dict[str, float] = {}
    with simulated_cluster(head_cpus=args.node_cpus) as sim:
        workers = [sim.add_node(num_cpus=args.node_cpus) for _ in range(extra_nodes)]
        names = {sim.head_id: "head", **{w.node_id: f"node{i + 1}" for i, w in enumerate(workers)}}
        lost: list[str] = []
        done = threading.Event()

        def killer() -> None:
            victim = workers[0]
            while not done.is_set():
                on_it = [t for t, nodes in trial_nodes(results).items() if victim.node_id in nodes]
                if on_it:
                    time.sleep(3)
                    sim.remove_node(victim)
                    events["kill"] = time.monotonic()
                    lost.extend(on_it)
                    return
                time.sleep(0.5)

        thread = threading.Thread(target=killer, daemon=True)
        if kill:
            thread.start()
        start = time.monotonic()
        result = search(spec, echo=lambda line: lines.append((time.monotonic(), line)))
        end = time.monotonic()
        done.set()
        if kill:
            thread.join()
    placed = Counter()
    for path in results.glob("search/*/*/trials/*/files/nodes.txt"):
        for line in path.read_text().splitlines():
            role, node = line.split()
            if role == "rank0":
                placed[names.get(node, node[:8])] += 1
    out = {"wall": end - start, "placed": dict(placed), "counts": result.counts}
    if kill and "kill" in events:
        t0 = events["kill"]
        after = [(t - t0, line) for t, line in lines if t >= t0]
        first = lambda test: next((round(dt, 1) for dt, line in after if test(line)), None)  # noqa: E731
        out["loss"] = {
            "cluster shrank": first(lambda line: line.startswith("cluster now holds")),
            "lost trial waits": first(lambda line: any(f"trial {t} waiting" in line for t in lost)),
            "lost trial placed again": first(lambda line: any(line == f"trial {t} placed" for t in lost)),
            "search ended": round(end - t0, 1),
        }
        keep = ("waiting", "placed", "cluster", "removed the worker group", "removed placement group", "retry")
        out["log"] = [f"+{dt:.1f}s {line[:160]}" for dt, line in after if any(k in line for k in keep)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--node-cpus", type=int, default=3)
    parser.add_argument("--loss-only", action="store_true", help="only the node-loss layout (its wall is then not compared)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        root = tmp / "synth_tiny"
        synthesize(root, preset="tiny", seed=0, progress=False)
        layouts = [("1 node", 0, False), ("2 nodes", 1, False), ("2 nodes, one lost", 1, True)][2 if args.loss_only else 0 :]
        figures = {}
        for i, (label, extra, kill) in enumerate(layouts):
            figures[label] = run(tmp / f"run{i}", root, f"bench{i}", args, extra, kill)
    print(f"tiny search: {args.trials} trials x {args.epochs} epochs, 2 workers x 1 CPU per trial, concurrency 2, nodes of {args.node_cpus} CPUs")
    base = figures.get("1 node", {}).get("wall")
    for label, fig in figures.items():
        ratio = f" ({fig['wall'] / base:.2f}x of 1 node)" if base else ""
        print(f"{label:>18}: wall {fig['wall']:6.1f} s{ratio}  trials per node (rank 0, all attempts) {fig['placed']}  outcomes {fig['counts']}")
    loss = figures["2 nodes, one lost"].get("loss")
    if loss:
        print("node loss, seconds after the kill: " + ", ".join(f"{k} {v}" for k, v in loss.items()))
        for line in figures["2 nodes, one lost"]["log"]:
            print("   ", line)


if __name__ == "__main__":
    main()
