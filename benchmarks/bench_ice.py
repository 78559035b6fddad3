"""The training cost of ICE, IRM and TCP (papers/002) on the ICE base model, and their (nil) retrieval cost.

configs/ice_base_ice_tvr.yaml (D = 384, T_m = 32, g = 8, 25% shuffled) on a
TVR-shaped synthetic collection (3,072-d video, 768-d text, 5 queries per
video): training seconds per batch (forward + losses + backward + optimiser,
data excluded) of the bare base model and with each module alone and all
three, and the ratio to the bare model of the same run; then the efficiency
profile (parameters, FLOPs, ms per query), which only sees retrieval, where
the three modules are off: its rows must be the base model's.  TCP encodes
every batch's videos a second time (the shuffled sequences), so it is
expected to cost the most.

    .venv/bin/python benchmarks/bench_ice.py --steps 2 --batch-size 32 --train-videos 256 --val-videos 64 --test-videos 64
"""

from __future__ import annotations

import argparse

import torch

from _common import (
    add_collection_options, bench_collection, bench_system, machine, peak_rss_gib, step_seconds, tvr_config,
)
from prvrlab.data.collection import open_collection
from prvrlab.evaluation.profile import profile_config
from prvrlab.reports.profile import profile_table

PARTS = ("ice", "irm", "tcp")
TERMS = {"ice": "ice_corr", "irm": "ice_irm", "tcp": "ice_tcp"}


def only(*parts: str) -> dict[str, object]:
    """Overrides that keep ``parts`` on (plug-in part and loss term) and switch the others off."""
    out: dict[str, object] = {}
    for part in PARTS:
        out[f"plugins.ice.{part}"] = part in parts
        if part not in parts:
            out[f"losses.{TERMS[part]}.weight"] = 0.0
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_collection_options(p)
    p.add_argument("--batch-size", type=int, default=128, help="videos per batch (the paper: 128)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--amp", default="bf16", choices=["none", "bf16"])
    p.add_argument("--gallery", type=int, nargs="+", default=[500, 2500])
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    root = bench_collection(args)
    print(f"machine: {machine()}")
    variants = {
        "base": only(),
        "base + ICE": only("ice"),
        "base + IRM": only("irm"),
        "base + TCP": only("tcp"),
        "base + ICE + IRM + TCP": only(*PARTS),
    }
    baseline = None
    profiles = []
    for name, extra in variants.items():
        cfg = tvr_config(root, "ice_base_ice_tvr.yaml", **{"train.batch_size": args.batch_size, **extra})
        collection = open_collection(cfg.data)
        seconds = step_seconds(bench_system(cfg, collection), collection, batch_size=args.batch_size,
                               steps=args.steps, amp=args.amp)
        baseline = baseline or seconds
        print(
            f"{name:<24} training step ({args.amp}) {seconds:6.3f} s / {args.batch_size}-video batch  "
            f"x{seconds / baseline:5.2f} of base   peak RSS {peak_rss_gib():.2f} GiB"
        )
        if name in ("base", "base + ICE + IRM + TCP"):
            profiles.append(profile_config(cfg, galleries=args.gallery, name=name))
    print(profile_table(profiles))


if __name__ == "__main__":
    main()
