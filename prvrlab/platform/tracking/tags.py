"""The tags every training run and trial carries (derived generically from the config)."""

from __future__ import annotations

from prvrlab.platform.config import ExperimentConfig, plugin_tokens
from prvrlab.platform.tracking.store import git_commit

# Per-epoch metrics are logged at step = epoch counted from 1; runs without this tag counted from 0.
EPOCH_BASE_TAG = "prvrlab.epoch_base"


def provenance_tags(commit: str) -> dict[str, str]:
    """``git_commit`` and ``prvrlab.git_dirty`` (true | false | unknown) for a :func:`git_commit` value."""
    dirty = "unknown" if commit == "unknown" else str(commit.endswith("-dirty")).lower()
    return {"git_commit": commit, "prvrlab.git_dirty": dirty}


def run_tags(cfg: ExperimentConfig, commit: str | None = None) -> dict[str, str]:
    """Tags every training run carries (``commit``: a :func:`git_commit` value already known)."""
    return {
        "prvrlab.kind": "train",
        "backbone": cfg.backbone,
        "plugins": ",".join(plugin_tokens(cfg)) or "none",
        "losses": ",".join(t for t, s in cfg.losses.items() if s["weight"] > 0),
        "dataset": cfg.data.collection,
        "seed": str(cfg.train.seed),
        **provenance_tags(git_commit() if commit is None else commit),
        "config_hash": cfg.fingerprint(),
        EPOCH_BASE_TAG: "1",
    }
