"""The tags every training run and trial carries (derived generically from the config)."""

from __future__ import annotations

from prvrlab.platform.config import ExperimentConfig, plugin_tokens
from prvrlab.platform.tracking.store import git_commit

# Per-epoch metrics are logged at step = epoch counted from 1; runs without this tag counted from 0.
EPOCH_BASE_TAG = "prvrlab.epoch_base"


def run_tags(cfg: ExperimentConfig) -> dict[str, str]:
    """Tags every training run carries."""
    return {
        "prvrlab.kind": "train",
        "backbone": cfg.backbone,
        "plugins": ",".join(plugin_tokens(cfg)) or "none",
        "losses": ",".join(t for t, s in cfg.losses.items() if s["weight"] > 0),
        "dataset": cfg.data.collection,
        "seed": str(cfg.train.seed),
        "git_commit": git_commit(),
        "config_hash": cfg.fingerprint(),
        EPOCH_BASE_TAG: "1",
    }
