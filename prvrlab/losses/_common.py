"""Helpers shared by the loss modules (not a registered loss)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from prvrlab.models.base import BranchScores, ModelOutput


def check_branch(branch: object) -> str:
    """A branch name must be a non-empty identifier such as 'clip' or 'frame'."""
    if not isinstance(branch, str) or not branch.isidentifier():
        raise ValueError(f"branch must be a branch name such as 'clip' or 'frame', got {branch!r}")
    return branch


def check_number(value: object, name: str, *, minimum: float | None = None, strict: bool = False) -> float:
    """``value`` as a finite float (>= or > ``minimum``), else a ValueError naming ``name``."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and minimum is not None:
        ok = value > minimum if strict else value >= minimum
    if not ok:
        bound = "" if minimum is None else f" {'>' if strict else '>='} {minimum:g}"
        raise ValueError(f"{name} must be a finite number{bound}, got {value!r}")
    return float(value)


def check_int(value: object, name: str, *, minimum: int) -> int:
    """``value`` as an int >= ``minimum``, else a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def branch_scores(out: ModelOutput, branch: str, loss: str) -> BranchScores:
    """The scores of ``branch``; a ValueError listing the model's branches when absent."""
    try:
        return out.scores[branch]
    except KeyError:
        raise ValueError(
            f"{loss}: branch={branch!r} is not produced by the model; available: {', '.join(sorted(out.scores))}"
        ) from None


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
