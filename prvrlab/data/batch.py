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


_HOST_LENGTHS = "_prvrlab_host_lengths"  # the attribute a prefix mask carries its host-side row lengths in


def tag_lengths(mask: Tensor, lengths: np.ndarray) -> Tensor:
    """Mark the prefix mask ``mask`` (N, L) with its rows' real lengths (N,) as the host knows them; returns ``mask``.

    Whoever reads the mask's layout (:meth:`prvrlab.models.blocks.Packing.from_mask`) then takes it from
    these lengths instead of reading the mask back from the device (a wait on a GPU).  The caller
    vouches that row ``i`` is True on exactly its first ``lengths[i]`` slots.  The mark is a Python
    attribute: it stays with this tensor object only (:func:`mask_to` and :meth:`Batch.to` carry it over a
    move, a pickled :class:`Batch` carries it over to the process that unpickles it; a mask made anew,
    e.g. ``dataclasses.replace(batch, frame_mask=...)``, has none and is read back).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if mask.dim() != 2 or lengths.shape != (mask.shape[0],):
        raise ValueError(f"lengths of shape {lengths.shape} do not describe a mask of shape {tuple(mask.shape)}")
    if len(lengths) and (int(lengths.min()) < 0 or int(lengths.max()) > mask.shape[1]):
        raise ValueError(f"lengths must lie in [0, {mask.shape[1]}], got [{int(lengths.min())}, {int(lengths.max())}]")
    setattr(mask, _HOST_LENGTHS, lengths)
    return mask


def host_lengths(mask: Tensor | None) -> np.ndarray | None:
    """The host-side row lengths (N,) int64 ``mask`` was marked with by :func:`tag_lengths`, else None."""
    return getattr(mask, _HOST_LENGTHS, None)


def prefix_mask(lengths: np.ndarray, length: int | None = None) -> Tensor:
    """(N, L) bool CPU mask, True on the first ``lengths[i]`` slots of row ``i`` (L: ``length``, else the
    longest), marked with ``lengths`` (:func:`tag_lengths`)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    longest = int(lengths.max(initial=0)) if length is None else int(length)
    real = np.arange(longest)[None, :] < lengths[:, None]  # (N, L)
    return tag_lengths(torch.from_numpy(real), lengths)


def _keep_mark(source: Tensor, copy: Tensor) -> Tensor:
    """``copy`` (a move or page-locked copy of ``source``) marked with ``source``'s host lengths, if any."""
    lengths = host_lengths(source)
    return copy if lengths is None or copy is source else tag_lengths(copy, lengths)


def mask_to(mask: Tensor, device: torch.device | str, non_blocking: bool = False) -> Tensor:
    """``mask.to(device)``, keeping the host-side lengths it was marked with."""
    return _keep_mark(mask, mask.to(device, non_blocking=non_blocking))


_MASKS = ("frame_mask", "query_mask")  # the Batch fields that may carry host lengths
_MARKS = "_mask_lengths"  # their lengths in a pickled Batch


@dataclass
class Batch:
    """A batch of videos, each with all of its queries (queries contiguous per video).

    ``query_video`` maps every query to the row of its video in this batch, so
    ``query_video[i] == b`` means query ``i`` describes a moment of video ``b``.
    Videos in one rank's batch are distinct; the global batch of a DDP step is too, except when an epoch is a
    single short step whose videos do not divide by the workers (fewer training videos than ``train.batch_size``):
    then up to ``world_size - 1`` of its videos are dealt twice (:class:`~prvrlab.data.dataset.VideoBatchSampler`).
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

    def __getstate__(self) -> dict:
        """Pickled with the masks' host lengths: a loader worker's tensors travel without their Python attributes."""
        return {**self.__dict__, _MARKS: {name: host_lengths(getattr(self, name)) for name in _MASKS}}

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        marks = state.pop(_MARKS, {})
        self.__dict__.update(state)
        for name, lengths in marks.items():
            if lengths is not None:
                tag_lengths(getattr(self, name), lengths)

    @property
    def frame_lengths_host(self) -> np.ndarray | None:
        """(B,) int64 real frames per video as the host built ``frame_mask`` (:func:`tag_lengths`), else None."""
        return host_lengths(self.frame_mask)

    @property
    def query_lengths_host(self) -> np.ndarray | None:
        """(Nq,) int64 real tokens per query as the host built ``query_mask`` (:func:`tag_lengths`), else None."""
        return host_lengths(self.query_mask)

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
            f.name: _keep_mark(getattr(self, f.name), getattr(self, f.name).to(device, non_blocking=non_blocking))
            for f in fields(self)
            if isinstance(getattr(self, f.name), Tensor)
        }
        return replace(self, **moved)

    def pad_frames(self, length: int) -> "Batch":
        """A copy whose frames (and their mask, keeping its host lengths) are zero/False-padded to ``length``
        slots; the batch itself where they already have that many."""
        return self._pad("frames", "frame_mask", length, "frame")

    def pad_queries(self, length: int) -> "Batch":
        """A copy whose query tokens (and their mask, keeping its host lengths) are zero/False-padded to
        ``length`` slots; the batch itself where they already have that many."""
        return self._pad("queries", "query_mask", length, "query token")

    def _pad(self, name: str, mask_name: str, length: int, slot: str) -> "Batch":
        features, mask = getattr(self, name), getattr(self, mask_name)  # (N, L, D), (N, L)
        extra = int(length) - features.shape[1]
        if extra < 0:
            raise ValueError(f"cannot pad {features.shape[1]} {slot} slots to {length}")
        if extra == 0:
            return self
        padded = torch.nn.functional.pad(features, (0, 0, 0, extra))  # (N, length, D)
        padded_mask = _keep_mark(mask, torch.nn.functional.pad(mask, (0, extra)))  # (N, length)
        return replace(self, **{name: padded, mask_name: padded_mask})

    def pin_memory(self) -> "Batch":
        """A copy with every tensor in pinned memory (used by DataLoader)."""
        pinned = {
            f.name: _keep_mark(getattr(self, f.name), getattr(self, f.name).pin_memory())
            for f in fields(self)
            if isinstance(getattr(self, f.name), Tensor)
        }
        return replace(self, **pinned)
