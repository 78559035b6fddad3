"""Run the cells of an ablation spec one after the other in this process (no Ray), appending each
cell's final metrics and per-epoch history to docs/<spec name>/results.jsonl; table.py writes the
Table 3 report.md from docs/ablation_ice_table3_synth/results.jsonl.

    .venv/bin/python docs/ablation_ice_table3_synth/run_in_process.py search_spaces/ablation_ice_table3_synth.yaml [cell,cell,...]

For machines where no Ray cluster may be started; elsewhere use `prvrlab ablate` on the same spec.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from prvrlab.data.synth import synthesize_if_missing
from prvrlab.platform.config import apply_overrides, validate
from prvrlab.platform.search.spec import load_ablation_spec
from prvrlab.platform.train.driver import train

DOCS = Path(__file__).resolve().parents[1]


def main() -> None:
    spec = load_ablation_spec(sys.argv[1])
    only = sys.argv[2].split(",") if len(sys.argv) > 2 else None
    out = DOCS / spec.name / "results.jsonl"
    out.parent.mkdir(exist_ok=True)
    data = spec.base_raw["data"]
    root = synthesize_if_missing(data["root"], preset=data["synthesize"], seed=0)
    for cell, overrides in spec.cells().items():
        if only and cell not in only:
            continue
        raw = apply_overrides(spec.base_raw, overrides)
        raw["data"]["root"] = str(root)
        raw["tracking"] = {**raw.get("tracking", {}), "experiment": spec.name}
        start = time.time()
        result = train(validate(raw), use_ray=False, echo=None)
        record = {"cell": cell, "seconds": time.time() - start, "final": result.final_metrics, "history": result.history}
        with out.open("a") as f:
            f.write(json.dumps(record, default=float) + "\n")
        print(cell, round(record["seconds"]), round(result.final_metrics["test/sumr"], 1), flush=True)


if __name__ == "__main__":
    main()
