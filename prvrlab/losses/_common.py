"""Helpers shared by the loss modules (not a registered loss)."""

from __future__ import annotations

import torch
from torch import Tensor

from prvrlab.checks import check_identifier
from prvrlab.data.batch import Batch
from prvrlab.models.base import BranchScores, ModelOutput


def check_branch(branch: object) -> str:
    """A branch name: a non-empty identifier such as 'clip' or 'frame'."""
    return check_identifier(branch, "branch", "'clip' or 'frame'")


def branch_scores(out: ModelOutput, branch: str, loss: str) -> BranchScores:
    """The scores of ``branch``; a ValueError listing the model's branches when absent."""
    try:
        return out.scores[branch]
    except KeyError:
        raise ValueError(
            f"{loss}: branch={branch!r} is not produced by the model; available: {', '.join(sorted(out.scores))}"
        ) from None


def query_vectors(out: ModelOutput, branch: str, loss: str) -> Tensor:
    """(Nq, D) query vectors of ``branch``; a ValueError listing the model's query branches when absent."""
    try:
        return out.query.vectors[branch]
    except KeyError:
        raise ValueError(
            f"{loss}: branch={branch!r} has no query vector; available: {', '.join(sorted(out.query.vectors))}"
        ) from None


def positives(scores: BranchScores, batch: Batch) -> Tensor:
    """(Nq,) long column of each query's positive: ``scores.targets`` where the branch sets them,
    else the batch's ``query_video`` (the columns are the batch's videos)."""
    return batch.query_video if scores.targets is None else scores.targets


def positive_mask(query_video: Tensor, num_videos: int) -> Tensor:
    """(Nq, Nv) bool, True where query i belongs to video v."""
    videos = torch.arange(num_videos, device=query_video.device)  # (Nv,)
    return query_video[:, None] == videos[None, :]  # (Nq, Nv)


def plugin_aux(out: ModelOutput, keys: tuple[str, ...], loss: str) -> list[Tensor]:
    """``out.aux[key]`` for every key; a ValueError naming the plug-in to enable when one is missing."""
    missing = [k for k in keys if k not in out.aux]
    if missing:
        plugin = missing[0].split(".", 1)[0]
        raise ValueError(
            f"{loss}: the model output has no {', '.join(repr(k) for k in missing)}; this loss needs the "
            f"'{plugin}' plug-in enabled with the part that produces them (config section plugins.{plugin})"
        )
    return [out.aux[k] for k in keys]
