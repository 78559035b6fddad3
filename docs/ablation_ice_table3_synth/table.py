"""Write report.md from the cells run by run_in_process.py (results.jsonl beside this file).

    .venv/bin/python docs/ablation_ice_table3_synth/table.py
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent
VARIANTS = ("base", "ice", "irm", "tcp", "irm_tcp", "ice_tcp", "ice_irm", "ice_irm_tcp")  # Table 3 rows 1-8
METRICS = ("r1", "r5", "r10", "r100", "sumr")


def mean_std(xs: list[float]) -> str:
    if not xs:
        return "—"
    if len(xs) == 1:
        return f"{xs[0]:.1f}"
    return f"{statistics.fmean(xs):.1f} ± {statistics.stdev(xs):.1f}"


def main() -> None:
    cells = [json.loads(line) for line in (HERE / "results.jsonl").read_text().splitlines() if line.strip()]
    by_variant: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for cell in cells:
        by_variant[cell["cell"].rsplit("/seed", 1)[0]].append(cell)
    base_sumr = statistics.fmean(c["final"]["test/sumr"] for c in by_variant["base"])
    lines = [
        "# Ablation: ablation_ice_table3_synth (papers/002, Table 3) — run in-process",
        "",
        "Cells of `search_spaces/ablation_ice_table3_synth.yaml` (ICE base model, synthetic `small` collection,",
        "hidden 128, 4 epochs, 1 worker) trained one after the other in-process by `run_in_process.py`",
        "(`prvrlab.platform.train.driver.train(..., use_ray=False)`), because no Ray cluster may be started on the",
        "shared development machine; `prvrlab ablate` + `prvrlab report` on the same spec give the full report",
        "(confidence intervals, significance). Test split; mean ± std over the seeds listed (a single value: one seed); ΔSumR against row 1.",
        "",
        "| Row | Variant | ICE | IRM | TCP | R@1 | R@5 | R@10 | R@100 | SumR | ΔSumR | val SumR | Seeds |",
        "|--:|:--|:-:|:-:|:-:|--:|--:|--:|--:|--:|--:|--:|:--|",
    ]
    for row, variant in enumerate(VARIANTS, 1):
        runs = by_variant[variant]
        on = ["✓" if part in variant.split("_") else "–" for part in ("ice", "irm", "tcp")]
        cols = [mean_std([c["final"][f"test/{m}"] for c in runs]) for m in METRICS]
        delta = statistics.fmean(c["final"]["test/sumr"] for c in runs) - base_sumr if runs else float("nan")
        val = mean_std([c["final"]["val/sumr"] for c in runs])
        seeds = ", ".join(c["cell"].rsplit("/seed", 1)[1] for c in runs)
        lines.append(f"| {row} | {variant} | {' | '.join(on)} | {' | '.join(cols)} | {delta:+.1f} | {val} | {seeds} |")
    lines += [
        "",
        "## ICE mining and TCP (last epoch, training split)",
        "",
        "| Variant | mined / batch | mined / epoch | precision | chance | TCP accuracy (shuffled) |",
        "|:--|--:|--:|--:|--:|--:|",
    ]
    for variant in VARIANTS:
        last = [c["history"][-1] for c in by_variant[variant]]
        if not any("train/ice.mined" in h or "train/ice.tcp_accuracy" in h for h in last):
            continue
        cols = [mean_std([h[k] for h in last if k in h]) for k in ("train/ice.mined", "train/ice.mined_total")]
        cols += [
            (lambda xs: f"{statistics.fmean(xs):.3f}" if xs else "—")([h[k] for h in last if k in h])
            for k in ("train/ice.precision", "train/ice.precision_chance", "train/ice.tcp_accuracy")
        ]
        lines.append(f"| {variant} | {' | '.join(cols)} |")
    lines += [
        "",
        "Precision: share of the mined (moment, text) pairs whose text truly fits the moment's video (the",
        "synthetic generator's ground truth, per video); chance: the same share among all unpaired",
        "(text, video) pairs of the batches. Seconds per cell: "
        + ", ".join(f"{c['cell']} {c['seconds']:.0f}" for c in cells) + ".",
        "",
    ]
    (HERE / "report.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
