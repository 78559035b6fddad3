"""The batch that flows from the data loader into every model and loss."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import numpy as np
import torch
from torch import Tensor


def host_to_device(array: np.ndarray, device: torch.device) -> Tensor:
    """``array`` as a tensor on ``device``; to CUDA through page-locked memory, so the host does not wait."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if torch.device(device).type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


@dataclass
class Batch:
    """A batch of videos, each with all of its queries (queries contiguous per video).

    ``query_video`` maps every query to the row of its video in this batch, so
    ``query_video[i] == b`` means query ``i`` describes a moment of video ``b``.
    Videos in a batch are distinct.
    """

    frames: Tensor  # (B, Lf, Dv) float, frame features (<= max_frames), zero padded
    frame_mask: Tensor  # (B, Lf) bool, True on real frames
    clips: Tensor  # (B, Lc, Dv) float, Lc = num_clips (always full)
    queries: Tensor  # (Nq, Lq, Dq) float, token features, zero padded
    query_mask: Tensor  # (Nq, Lq) bool, True on real tokens
    query_video: Tensor  # (Nq,) long, index of each query's video in this batch
    video_ids: list[str]
    query_ids: list[str]
    # (Nq,) int64, ``query_video`` as the host built it: read there without waiting for the device
    query_video_host: np.ndarray | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        host = self.query_video_host
        if host is not None and host.shape != tuple(self.query_video.shape):
            raise ValueError(f"query_video_host has shape {host.shape}, query_video {tuple(self.query_video.shape)}")

    def host_query_video(self) -> np.ndarray:
        """``query_video`` on the host, (Nq,) int64: the batch's host copy, else read from the tensor (a wait on a GPU)."""
        if self.query_video_host is not None:
            return self.query_video_host
        return self.query_video.detach().cpu().numpy().astype(np.int64)

    @property
    def num_videos(self) -> int:
        return int(self.frames.shape[0])

    @property
    def num_queries(self) -> int:
        return int(self.queries.shape[0])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        """A copy with every tensor moved to ``device``."""
        moved = {
            f.name: getattr(self, f.name).to(device, non_blocking=non_blocking)
            for f in fields(self)
            if isinstance(getattr(self, f.name), Tensor)
        }
        return replace(self, **moved)

    def pin_memory(self) -> "Batch":
        """A copy with every tensor in pinned memory (used by DataLoader)."""
        pinned = {
            f.name: getattr(self, f.name).pin_memory()
            for f in fields(self)
            if isinstance(getattr(self, f.name), Tensor)
        }
        return replace(self, **pinned)
