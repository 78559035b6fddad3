"""An ablation's sensitivity table is one-at-a-time: a variant that changes other keys too is not pooled into a
key's row (the parity ablation's `corrected` variant, six keys, had been credited to model.window_length)."""

from __future__ import annotations

from prvrlab.reports.report import _ablation_sweeps, ablation_cells

from report_helpers import fake_run, fake_study


def _study(overrides: dict[str, dict]):
    runs = []
    for variant, changed in overrides.items():
        run = fake_run(variant, 0, [1, 2, 3, 50])
        run.params.update({"plugins.ice.groups": "8", "train.lr": "0.001", **{k: str(v) for k, v in changed.items()}})
        runs.append(run)
    study = fake_study(runs, {}, baseline="g8", seeds=[0])
    study.spec["variants"] = overrides
    return study


def test_only_variants_changing_that_key_alone_are_pooled():
    study = _study({
        "g8": {},
        "g4": {"plugins.ice.groups": 4},
        "g16": {"plugins.ice.groups": 16},
        "g32_fast": {"plugins.ice.groups": 32, "train.lr": 0.01},  # two keys: neither sweep's
        "lr2": {"train.lr": 0.002},
    })
    rows, chosen, _, _ = ablation_cells(study, "test")
    sweeps = _ablation_sweeps(study, rows, chosen)
    assert sorted(sweeps) == ["plugins.ice.groups"]  # train.lr: 0.001 and 0.002 alone, fewer than 3 values
    assert sorted((value, run.variant) for value, run in sweeps["plugins.ice.groups"]) == [
        (4, "g4"), (8, "g8"), (16, "g16")]


def test_a_key_swept_alone_across_every_variant_keeps_all_of_them():
    study = _study({"g8": {}, "g4": {"plugins.ice.groups": 4}, "g16": {"plugins.ice.groups": 16},
                    "g32": {"plugins.ice.groups": 32}})
    rows, chosen, _, _ = ablation_cells(study, "test")
    assert sorted(v for v, _ in _ablation_sweeps(study, rows, chosen)["plugins.ice.groups"]) == [4, 8, 16, 32]
