"""Test-only components that exercise the extension seam (registered on import under ``test_*`` names).

- ``test_tempered_nce``: an InfoNCE loss with a learnable temperature (a parameter outside the model).
- ``test_epoch_probe``: a loss that uses every hook: a dataset-wide pass at epoch start (per-frame
  embeddings, all-reduced over ranks; the real frames per video as the distribution ``frames``), a
  step counter, and metrics from the epoch end.
- ``test_twin``: a plug-in holding a second backbone copy that contributes to retrieval scores.
- ``test_nan_on_rank``: zero (with a graph) until ``from_step`` steps were taken, then NaN on one rank
  (``rank``; -1: every rank).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from prvrlab.losses.base import Loss
from prvrlab.models.base import BranchScores
from prvrlab.models.component import FRAME_TOKENS, QUERY_GROUPS
from prvrlab.models.plugins.base import Plugin
from prvrlab.registry import LOSSES, PLUGINS


def _register(registry, name: str, cls):
    if name not in registry._items:  # importable more than once (pytest, spawned workers)
        registry.register(name)(cls)
    return registry.get(name)


class TemperedNCE(Loss):
    """Query->video cross-entropy over ``sim / T`` of one branch, with T = exp(log_temperature) learned."""

    def __init__(self, *, branch: str = "clip", init_log_temperature: float = 0.0) -> None:
        super().__init__()
        self.branch = branch
        self.log_temperature = nn.Parameter(torch.tensor(float(init_log_temperature)))

    def metric_names(self) -> tuple[str, ...]:
        return ("temperature",)

    def forward(self, out, batch, *, epoch: int) -> Tensor:
        temperature = self.log_temperature.exp()
        self.log_metric("temperature", temperature)
        logits = out.scores[self.branch].sim.float() / temperature  # (Nq, B)
        return nn.functional.cross_entropy(logits, batch.query_video)


class EpochProbe(Loss):
    """Counts what the epoch hooks see; contributes a zero loss that still has a graph."""

    def __init__(self, *, branch: str = "clip") -> None:
        super().__init__()
        self.branch = branch
        self.steps = 0
        self.seen_training_mode: list[bool] = []

    def needs(self, *, training: bool) -> frozenset[str]:
        return frozenset({FRAME_TOKENS, QUERY_GROUPS})

    def metric_names(self) -> tuple[str, ...]:
        return ("videos", "frames", "frame_norm", "steps", "truly_relevant", "steps_with_truth")

    def on_epoch_start(self, ctx) -> dict[str, float]:
        self.steps = self.steps_with_truth = 0
        totals = torch.zeros(4, dtype=torch.float64)  # videos, real frames, sum of frame-token norms, relevant pairs
        lengths = []  # real frames per video, logged as a distribution
        for batch in ctx.train_batches():
            totals[3] += float(ctx.truth.relevant(batch.query_ids, batch.video_ids).sum())
            video, _ = ctx.encode(batch)
            self.seen_training_mode.append(ctx.model.training)
            tokens, mask = video.frame_tokens()  # (B, Lf, D), (B, Lf)
            lengths.append(mask.sum(dim=1))
            totals[:3] += torch.tensor(
                [tokens.shape[0], float(mask.sum()), float(tokens[mask].float().norm(dim=-1).sum())], dtype=torch.float64
            )
        totals = ctx.all_reduce(totals)
        self.log_distribution("frames", {"all": torch.cat(lengths)}, low=0.0, high=64.0, bins=8)
        return {
            "videos": float(totals[0]),
            "frames": float(totals[1]),
            "frame_norm": float(totals[2] / totals[1]),
            "truly_relevant": float(totals[3]),
        }

    def on_step_end(self, ctx) -> None:
        self.steps += 1
        self.steps_with_truth += ctx.truth is not None

    def on_epoch_end(self, ctx) -> dict[str, float]:
        return {"steps": float(self.steps), "steps_with_truth": float(self.steps_with_truth)}

    def forward(self, out, batch, *, epoch: int) -> Tensor:
        return out.scores[self.branch].sim.sum() * 0.0


class TwinEncoder(Plugin):
    """A second copy of the backbone; retrieval scores are ``(1 - mix) * own + mix * twin`` per branch."""

    def __init__(self, *, hidden_size: int, mix: float = 0.5) -> None:
        super().__init__()
        self.mix = float(mix)

    def attach(self, backbone, *, make_backbone) -> None:
        super().attach(backbone, make_backbone=make_backbone)
        self.twin = make_backbone()

    def encode_videos(self, clips, frames, frame_mask, video):
        return {"video": self.twin.encode_videos(clips, frames, frame_mask)}

    def encode_queries(self, queries, query_mask, query):
        return {"query": self.twin.encode_queries(queries, query_mask)}

    def adjust_scores(self, query, video, scores, *, with_logits: bool):
        twin = self.twin.score(query.extra["test_twin.query"], video.extra["test_twin.video"], with_logits=with_logits)
        out = {}
        for branch, own in scores.items():
            logits = None
            if own.logits is not None and twin[branch].logits is not None:
                logits = (1 - self.mix) * own.logits + self.mix * twin[branch].logits
            out[branch] = BranchScores(sim=(1 - self.mix) * own.sim + self.mix * twin[branch].sim, logits=logits)
        return out


class NanOnRank(Loss):
    """0 x a score (a graph, no gradient) for the first ``from_step`` calls, then NaN on ``rank`` (-1: all)."""

    def __init__(self, *, rank: int = -1, from_step: int = 1) -> None:
        super().__init__()
        self.rank, self.from_step, self.calls = rank, from_step, 0

    def forward(self, out, batch, *, epoch: int) -> Tensor:
        import torch.distributed as dist

        here = dist.get_rank() if dist.is_initialized() else 0
        self.calls += 1
        broken = self.calls > self.from_step and self.rank in (-1, here)
        return out.scores["clip"].sim.mean() * (float("nan") if broken else 0.0)


TemperedNCE = _register(LOSSES, "test_tempered_nce", TemperedNCE)
NanOnRank = _register(LOSSES, "test_nan_on_rank", NanOnRank)
EpochProbe = _register(LOSSES, "test_epoch_probe", EpochProbe)
TwinEncoder = _register(PLUGINS, "test_twin", TwinEncoder)
