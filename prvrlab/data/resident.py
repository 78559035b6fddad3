"""A split's preprocessed features held on the training device, batched by index (``data.resident``).

The training loader reads, preprocesses and collates every batch again each
epoch (and validation its split) and carries it to the device: at TVR's
dimensions a batch of 128 videos is 240 MiB of float32, which bounds GPU
training (docs/performance.md, "On a GPU").  A :class:`ResidentSplit` does that work once:
every video's frames (at most ``max_frames`` rows, as
:func:`~prvrlab.data.preprocess.preprocess_frames` makes them), clips and query
tokens are packed into three tensors on the device, and
:meth:`ResidentSplit.batch` gathers and pads a training batch there
(:meth:`~ResidentSplit.videos` and :meth:`~ResidentSplit.queries` the
evaluation batches).  Its batches equal :func:`~prvrlab.data.dataset.collate`'s
(and the evaluation iterators'), value for value.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from prvrlab.data.batch import Batch, host_to_device, tag_lengths
from prvrlab.data.collection import Collection, SplitIndex
from prvrlab.data.dataset import VideoDataset
from prvrlab.data.errors import DataError
from prvrlab.data.index_cache import stamp

MEMORY_SHARE = 0.8  # the largest share of the device's free memory a split may take

_HELD: dict[tuple, "ResidentSplit"] = {}  # the splits this process's last run held, for its next run


def _segments(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """(R,) rows ``starts[k] + t`` for every segment ``k`` and ``t < lengths[k]``, in order."""
    pos = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)  # (R,) t of each row
    return np.repeat(starts, lengths) + pos


def _offsets(lengths: np.ndarray) -> np.ndarray:
    """(n + 1,) int64 start of every segment and the end of the last."""
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def _size(nbytes: int) -> str:
    """Bytes as GiB, or MiB below one GiB."""
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def available_bytes(device: torch.device) -> int | None:
    """Free memory of ``device``, None if unknown.  CUDA: the driver's free bytes.  CPU: what the OS can
    give without swapping (Linux's MemAvailable: free pages and reclaimable page cache, which a machine
    that has read large feature files holds a lot of; else the free pages), capped by what the process's
    memory cgroup (a container's or a job's limit) can still take (:func:`cgroup_headroom`)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu":
        return None
    known = [v for v in (_host_available(), cgroup_headroom()) if v is not None]
    return min(known) if known else None


def _host_available() -> int | None:
    """/proc/meminfo's MemAvailable (bytes); the free pages where there is no such line; None if unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    if hasattr(os, "sysconf"):
        try:
            return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError):
            return None
    return None


_NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as 2^63 - 1 rounded down to a page


def _cgroup_value(path: Path) -> int | None:
    """An integer cgroup file's value; None when absent, unreadable, ``max`` or v1's no-limit value."""
    try:
        value = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    return None if value >= _NO_LIMIT else value


def _cgroup_stat(path: Path, key: str) -> int:
    """``key``'s value in a cgroup ``memory.stat`` file (0 when absent)."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def cgroup_headroom(*, root: Path = Path("/sys/fs/cgroup"), membership: str | None = None) -> int | None:
    """Bytes this process's memory cgroup can still take before its limit: limit − (usage − inactive page
    cache), the smallest over the cgroup and those above it that set a limit (cgroup v1 and v2); None when
    none sets one or nothing is readable.  ``membership``: ``/proc/self/cgroup``'s text (read by default);
    ``root``: where the cgroup file systems are mounted."""
    if membership is None:
        try:
            membership = Path("/proc/self/cgroup").read_text()
        except OSError:
            return None
    v1 = v2 = None
    for line in membership.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if "memory" in parts[1].split(","):
            v1 = parts[2]
        elif parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
    if v1 is not None:  # a v1 memory controller (also in hybrid set-ups, where v2 has no memory files)
        base, rel, names = root / "memory", v1, ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    elif v2 is not None:
        base, rel, names = root, v2, ("memory.max", "memory.current", "inactive_file")
    else:
        return None
    level = base / rel.strip("/")
    if not level.is_dir():  # a cgroup namespace: the process's own cgroup is mounted as the root
        level = base
    room = []
    while True:
        limit, usage = _cgroup_value(level / names[0]), _cgroup_value(level / names[1])
        if limit is not None and usage is not None:
            room.append(max(0, limit - max(0, usage - _cgroup_stat(level / "memory.stat", names[2]))))
        if level == base or base not in level.parents:
            break
        level = level.parent
    return min(room) if room else None


class _Videos(Dataset):
    """Item ``i``: video ``i``'s preprocessed frames and clips and its queries' tokens, as tensors."""

    def __init__(self, dataset: VideoDataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor, Tensor]:
        item = self.dataset[i]
        return torch.from_numpy(item.frames), torch.from_numpy(item.clips), torch.from_numpy(np.concatenate(item.queries))


class ResidentSplit:
    """Every video of ``split`` preprocessed once and held on ``device``; :meth:`batch` makes a Batch there.

    ``num_workers`` processes read the features while the split is loaded.
    Raises DataError naming ``data.resident`` when the split would take more
    than :data:`MEMORY_SHARE` of the device's free memory.
    """

    def __init__(self, collection: Collection, split: str | SplitIndex, *, device: torch.device | str,
                 num_workers: int = 0) -> None:
        self.device = torch.device(device)
        dataset = VideoDataset(collection, split)
        index = self.index = dataset.index
        self.frame_len = np.minimum(index.frame_counts, collection.max_frames).astype(np.int64)  # (Nv,)
        self.query_len = np.minimum(index.token_counts, collection.max_query_len).astype(np.int64)  # (Nq,)
        self.frame_start = _offsets(self.frame_len)  # (Nv + 1,)
        self.token_start = _offsets(self.query_len)  # (Nq + 1,)
        dv, dq, nv = collection.video_dim, collection.query_dim, index.num_videos
        self.nbytes = index.preprocessed_bytes(max_frames=collection.max_frames, num_clips=collection.num_clips,
                                               max_query_len=collection.max_query_len, video_dim=dv, query_dim=dq)
        free = available_bytes(self.device)
        if free is not None and self.nbytes > MEMORY_SHARE * free:
            raise DataError(
                f"data.resident: the {index.name!r} split's preprocessed features need {_size(self.nbytes)} "
                f"on {self.device}, and {_size(free)} is free (at most {MEMORY_SHARE:.0%} of it is used); "
                "set data.resident: false to stream batches through the loader"
            )
        f32 = {"dtype": torch.float32, "device": self.device}
        self.frames = torch.zeros((int(self.frame_start[-1]) + 1, dv), **f32)  # (sum Lf + 1, Dv): last row zero, padding
        self.clips = torch.empty((nv, collection.num_clips, dv), **f32)  # (Nv, Lc, Dv)
        self.tokens = torch.zeros((int(self.token_start[-1]) + 1, dq), **f32)  # (sum Lq + 1, Dq): last row zero, padding
        loader = DataLoader(_Videos(dataset), batch_size=None, num_workers=num_workers,
                            generator=torch.Generator("cpu").manual_seed(0))
        for i, (frames, clips, tokens) in enumerate(loader):
            span = index.queries_of(i)
            tokens_expected = self.token_start[span.stop] - self.token_start[span.start]
            if frames.shape[0] != self.frame_len[i] or tokens.shape[0] != tokens_expected:
                raise DataError(f"{collection.visual!r}: video {index.video_ids[i]!r} has other frame or token "
                                "counts than its split index recorded")
            self.frames[self.frame_start[i] : self.frame_start[i + 1]] = frames
            self.clips[i] = clips
            self.tokens[self.token_start[span.start] : self.token_start[span.stop]] = tokens

    def __len__(self) -> int:
        return self.index.num_videos

    def _padded(self, rows: Tensor, starts: np.ndarray, lengths: np.ndarray) -> tuple[Tensor, Tensor]:
        """Segments of ``rows`` zero-padded to the longest: (N, L, D) and its (N, L) mask of real rows
        (marked with ``lengths``: :func:`~prvrlab.data.batch.tag_lengths`).

        One gather: a padding slot reads the zero row that ends ``rows``.
        """
        longest = int(lengths.max())
        real = np.arange(longest)[None, :] < lengths[:, None]  # (N, L)
        source = np.where(real, starts[:, None] + np.arange(longest)[None, :], rows.shape[0] - 1)  # (N, L)
        out = rows.index_select(0, host_to_device(source.reshape(-1), self.device))  # (N * L, D)
        return out.view(len(lengths), longest, rows.shape[1]), tag_lengths(host_to_device(real, self.device), lengths)

    def videos(self, positions: Sequence[int]) -> tuple[Tensor, Tensor, Tensor]:
        """``(clips (B, Lc, Dv), frames (B, Lf, Dv), frame_mask (B, Lf))`` of these videos, frames padded to the longest."""
        if len(positions) == 0:
            raise ValueError("a batch needs at least one video")
        v = np.asarray(positions, dtype=np.int64)  # (B,)
        frames, frame_mask = self._padded(self.frames, self.frame_start[v], self.frame_len[v])
        return self.clips[host_to_device(v, self.device)], frames, frame_mask

    def queries(self, positions: Sequence[int]) -> tuple[Tensor, Tensor]:
        """``(queries (N, Lq, Dq), query_mask (N, Lq))`` of these queries (split positions), padded to the longest."""
        q = np.asarray(positions, dtype=np.int64)  # (N,)
        return self._padded(self.tokens, self.token_start[q], self.query_len[q])

    def batch(self, videos: Sequence[int]) -> Batch:
        """The Batch :func:`~prvrlab.data.dataset.collate` makes of these videos (split positions), on the device."""
        clips, frames, frame_mask = self.videos(videos)  # (B, Lc, Dv), (B, Lf, Dv), (B, Lf)
        v = np.asarray(videos, dtype=np.int64)  # (B,)
        index = self.index
        counts = index.query_offsets[v + 1] - index.query_offsets[v]  # (B,)
        q = _segments(index.query_offsets[v], counts)  # (Nq,) split positions of the batch's queries
        queries, query_mask = self.queries(q)  # (Nq, Lq, Dq), (Nq, Lq)
        host = np.repeat(np.arange(len(v), dtype=np.int64), counts)  # (Nq,)
        return Batch(
            frames=frames,
            frame_mask=frame_mask,
            clips=clips,
            queries=queries,
            query_mask=query_mask,
            query_video=host_to_device(host, self.device),  # (Nq,)
            video_ids=[index.video_ids[i] for i in v],
            query_ids=[index.query_ids[j] for j in q],
            query_video_host=host,
        )


def _signature(path: Path) -> tuple:
    """The version (:func:`~prvrlab.data.index_cache.stamp`) of a file, or of every file of a folder (a BigFile)."""
    files = sorted(path.iterdir()) if path.is_dir() else [path]
    return tuple((f.name, *stamp(f.stat())) for f in files if f.is_file())


def _key(collection: Collection, index: SplitIndex, device: torch.device) -> tuple:
    """What a held split was made from: files (paths, sizes, modification times), split, preprocessing, device."""
    paths = (Path(collection.visual.path), Path(collection.queries.path), Path(index.caption_file))
    return (
        tuple((str(p), _signature(p)) for p in paths),
        index.name,
        (collection.max_frames, collection.num_clips, collection.max_query_len, collection.last_bin, collection.normalize),
        str(device),
    )


def hold_splits(collection: Collection, splits: Sequence[str], *, device: torch.device | str,
                num_workers: int = 0) -> dict[str, ResidentSplit]:
    """``splits`` held on ``device``, each reused from this process's previous run where nothing it was made from changed.

    A search's reused worker pool (``resources.reuse_workers``) runs one trial
    after another in the same ranks: only the first loads the splits. The key is
    the feature, query and caption files (paths, sizes, modification times),
    the split, the preprocessing and the device. Splits held for other keys are
    let go before anything loads.
    """
    device = torch.device(device)
    keys = {name: _key(collection, collection.split(name), device) for name in dict.fromkeys(splits)}
    for key in [k for k in _HELD if k not in keys.values()]:
        del _HELD[key]
    for name, key in keys.items():
        if key not in _HELD:
            _HELD[key] = ResidentSplit(collection, name, device=device, num_workers=num_workers)
    return {name: _HELD[key] for name, key in keys.items()}


def release_held() -> None:
    """Let go of the splits this process holds (a run without ``data.resident`` frees them for the model)."""
    _HELD.clear()
