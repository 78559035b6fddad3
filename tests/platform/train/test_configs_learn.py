"""Every shipped synthetic config learns: its backbone, plug-ins and losses, shrunk to the tiny collection,
reach a validation SumR 30 above the same model untrained within 6 epochs (they gained 38-81 when
written), with seed 0 or, when seed 0 falls short, seed 1 (ICE on ice_base gained +26 / +50 / +55 with
seeds 0 / 1 / 2 after session 47's L_red fix, +38 / +36 / +63 before: one seed's 6 tiny epochs vary). ARL's triplets once took hardest members from the first step and ARL stayed near chance while
its loss fell (+25 at best here); hand-loop tests of the loss could not see that."""

from __future__ import annotations

from pathlib import Path

import pytest

from prvrlab.platform.config import load_raw
from prvrlab.registry import BACKBONES

from train_helpers import untrained_val_sumr, val_sumr_by_epoch

CONFIGS = sorted((Path(__file__).resolve().parents[3] / "configs").glob("*_synth.yaml"))


def tiny_raw(path: Path, root: Path, tmp: Path) -> dict:
    """The config with its model shrunk (width 32, 2 heads, no dropout) and 6 short epochs on ``root``."""
    raw = load_raw(path)  # its extends resolved
    raw["data"] = {"root": str(root), "collection": "synth", "visual_feature": "synth_feat"}
    known = BACKBONES.params(raw["model"]["name"])
    raw["model"].update({k: v for k, v in {"hidden_size": 32, "num_heads": 2, "dropout": 0.0}.items() if k in known})
    if "ffn_size" in raw["model"]:
        raw["model"]["ffn_size"] = 64
    if "arl" in raw.get("plugins", {}):
        raw["plugins"]["arl"]["warmup_epochs"] = 1  # its detection runs in epochs 2-6
    raw["train"] = {"epochs": 6, "batch_size": 16, "lr": 1e-3, "num_workers": 1, "seed": 0, "torch_threads": 1}
    raw["eval"] = {"final_splits": ["val"]}
    raw["tracking"] = {"uri": f"sqlite:///{tmp / 'mlflow.db'}", "experiment": "tests", "storage_path": str(tmp / "results")}
    return raw


@pytest.mark.slow
@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_the_config_learns(path, tiny_root, tmp_path, monkeypatch):
    """... and trains and evaluates without reading a mask's layout back from the device (a wait on a GPU):
    the loader's masks, also through its worker process, carry their host lengths."""
    import prvrlab.models.blocks as blocks

    def refuse(*args):
        raise AssertionError("a mask's layout was read back from the device")

    monkeypatch.setattr(blocks, "_read_layout", refuse)
    raw = tiny_raw(path, tiny_root, tmp_path)
    tried = []
    for seed in (0, 1):  # a second seed only when the first falls short: 6 tiny epochs vary by ~+-15 per seed
        raw["train"]["seed"] = seed
        before = untrained_val_sumr(raw)
        sumr = val_sumr_by_epoch(raw, tmp_path / f"run{seed}")
        tried.append((seed, before, sumr))
        if max(sumr) > before + 30:
            break
    assert max(sumr) > before + 30, tried
