"""Datasets, collation, the distributed video batch sampler and eval iterators.

A training sample is a video with all of its queries; :func:`collate` turns a
list of them into a :class:`~prvrlab.data.batch.Batch` whose queries are
contiguous per video.  :class:`VideoBatchSampler` splits each epoch's
permutation of videos across DDP ranks so that every rank yields the same
number of batches.  :func:`video_batches` and :func:`query_batches` iterate a
split in order for evaluation (videos and queries are encoded separately).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler

from prvrlab.data.batch import Batch, prefix_mask
from prvrlab.data.collection import Collection, SplitIndex
from prvrlab.data.preprocess import l2_normalize, preprocess_clips, preprocess_frames, preprocess_query

if TYPE_CHECKING:
    from prvrlab.data.resident import ResidentSplit


@dataclass
class VideoItem:
    """One preprocessed video with all of its queries."""

    video_id: str
    frames: np.ndarray  # (Lf, Dv) float32, Lf <= max_frames
    clips: np.ndarray  # (Lc, Dv) float32
    query_ids: list[str]
    queries: list[np.ndarray]  # each (Lq_i, Dq) float32, Lq_i <= max_query_len


class VideoDataset(Dataset):
    """Item ``i`` is video ``i`` of ``split`` with all its queries, preprocessed."""

    def __init__(self, collection: Collection, split: str | SplitIndex) -> None:
        self.collection = collection
        self.index = collection.split(split) if isinstance(split, str) else split

    def __len__(self) -> int:
        return self.index.num_videos

    def video(
        self, i: int, *, frames_out: np.ndarray | None = None, clips_out: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Preprocessed ``(frames (Lf, Dv), clips (Lc, Dv))`` of video ``i``, written into ``frames_out``
        / ``clips_out`` when given (e.g. rows of a padded batch; a ``frames_out`` of other than Lf rows is
        an error naming the video)."""
        c = self.collection
        video_id = self.index.video_ids[i]
        raw = c.visual.frames(video_id)  # (n, Dv)
        kept = min(raw.shape[0], c.max_frames)  # frames after preprocessing
        if frames_out is not None and frames_out.shape[0] != kept:
            raise ValueError(f"video {video_id!r}: {kept} frames after preprocessing, its index says {frames_out.shape[0]}")
        return (
            preprocess_frames(raw, c.max_frames, last_bin=c.last_bin, normalize=c.normalize, out=frames_out),
            preprocess_clips(raw, c.num_clips, last_bin=c.last_bin, normalize=c.normalize, out=clips_out),
        )

    def query(self, j: int) -> np.ndarray:
        """Preprocessed tokens (Lq, Dq) of query ``j`` of the split."""
        c = self.collection
        tokens = c.queries.tokens(self.index.query_ids[j], max_len=c.max_query_len)  # (Lq, Dq)
        return preprocess_query(tokens, c.max_query_len, normalize=c.normalize)

    def __getitem__(self, i: int) -> VideoItem:
        frames, clips = self.video(i)
        span = self.index.queries_of(i)
        return VideoItem(
            video_id=self.index.video_ids[i],
            frames=frames,
            clips=clips,
            query_ids=self.index.query_ids[span],
            queries=[self.query(j) for j in range(span.start, span.stop)],
        )


def pad_sequences(arrays: Sequence[np.ndarray]) -> tuple[Tensor, Tensor]:
    """Stack (L_i, D) arrays into zero-padded (N, L, D) float32 and a (N, L) bool mask marked with
    its lengths (:func:`~prvrlab.data.batch.tag_lengths`)."""
    lengths = np.fromiter((a.shape[0] for a in arrays), dtype=np.int64, count=len(arrays))  # (N,)
    longest = int(lengths.max())
    out = np.zeros((len(arrays), longest, arrays[0].shape[1]), dtype=np.float32)  # (N, L, D)
    for i, a in enumerate(arrays):
        out[i, : a.shape[0]] = a
    return torch.from_numpy(out), prefix_mask(lengths, longest)


def collate(items: Sequence[VideoItem]) -> Batch:
    """Collate videos (each with all its queries) into a Batch.

    Frames are padded to the longest video of the batch and queries to the
    longest query; queries stay contiguous per video and ``query_video``
    indexes the batch rows.
    """
    if not items:
        raise ValueError("collate needs at least one video")
    frames, frame_mask = pad_sequences([it.frames for it in items])  # (B, Lf, Dv), (B, Lf)
    clips = torch.from_numpy(np.stack([it.clips for it in items]))  # (B, Lc, Dv)
    queries, query_mask = pad_sequences([q for it in items for q in it.queries])  # (Nq, Lq, Dq), (Nq, Lq)
    counts = [len(it.queries) for it in items]
    host = np.repeat(np.arange(len(items), dtype=np.int64), counts)  # (Nq,)
    return Batch(
        frames=frames,
        frame_mask=frame_mask,
        clips=clips,
        queries=queries,
        query_mask=query_mask,
        query_video=torch.from_numpy(host),
        video_ids=[it.video_id for it in items],
        query_ids=[q for it in items for q in it.query_ids],
        query_video_host=host,
    )


class VideoBatchSampler(Sampler[list[int]]):
    """Distributed batch sampler over videos; ``batch_size`` is per rank.

    Each epoch draws a permutation of the videos (seeded by ``(seed, epoch)``;
    the identity when ``shuffle`` is false).  Global step ``s`` takes the next
    ``batch_size * world_size`` videos of the permutation and rank ``r`` gets
    the ``r``-th contiguous share, so the union over ranks of step ``s`` is the
    batch a single process with ``batch_size * world_size`` would see.  When
    the last step is short, it is split evenly over the ranks (``ceil(m /
    world_size)`` each), padding by wrapping around to the start of the
    permutation; with ``drop_last`` the short step is dropped.  Every rank
    therefore yields the same number of batches, as DDP requires.  The wrapped
    videos were trained in an earlier step of the epoch, except when the epoch
    is that one short step (fewer videos than ``batch_size * world_size``): then
    they repeat within it, so under a global batch such a video is also a
    negative of its own queries (the training loop says so when it happens).
    """

    def __init__(
        self,
        num_videos: int,
        batch_size: int,
        *,
        shuffle: bool,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = False,
    ) -> None:
        if num_videos < 1:
            raise ValueError(f"num_videos must be >= 1, got {num_videos!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank!r}, world_size={world_size!r}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed!r}")
        if drop_last and num_videos < batch_size * world_size:
            raise ValueError(
                f"drop_last with {num_videos} videos < batch_size * world_size = {batch_size * world_size} "
                "would yield no batch"
            )
        self.num_videos = num_videos
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.drop_last = drop_last
        self.epoch = 0

    def repeats_within_step(self) -> int:
        """How many videos each epoch deals twice within one step: those that fill up the shares of an epoch that
        is one short step (0 when it has several steps, or its videos divide by the ranks)."""
        step = self.batch_size * self.world_size
        if self.drop_last or self.num_videos >= step:
            return 0
        return math.ceil(self.num_videos / self.world_size) * self.world_size - self.num_videos

    def set_epoch(self, epoch: int) -> None:
        """Select the permutation of ``epoch`` (call before iterating each epoch)."""
        self.epoch = int(epoch)

    def permutation(self) -> np.ndarray:
        """This epoch's order of all videos, (num_videos,) int64."""
        if not self.shuffle:
            return np.arange(self.num_videos, dtype=np.int64)
        return np.random.default_rng([self.seed, self.epoch]).permutation(self.num_videos)

    def __len__(self) -> int:
        step = self.batch_size * self.world_size
        if self.drop_last:
            return self.num_videos // step
        return math.ceil(self.num_videos / step)

    def _steps(self) -> Iterator[tuple[np.ndarray, int]]:
        """Each step's global batch (every rank's share, in rank order) and the size of one share."""
        perm = self.permutation()
        step = self.batch_size * self.world_size
        for s in range(len(self)):
            chunk = perm[s * step : (s + 1) * step]
            share = self.batch_size
            if len(chunk) < step:
                share = math.ceil(len(chunk) / self.world_size)
                wrap = perm[np.arange(share * self.world_size - len(chunk)) % self.num_videos]
                chunk = np.concatenate([chunk, wrap])
            yield chunk, share

    def __iter__(self) -> Iterator[list[int]]:
        for chunk, share in self._steps():
            yield chunk[self.rank * share : (self.rank + 1) * share].tolist()

    def global_batches(self) -> Iterator[np.ndarray]:
        """This epoch's global batches, step by step: the videos of every rank's share, (world_size * share,)."""
        for chunk, _ in self._steps():
            yield chunk


def train_loader(
    collection: Collection,
    split: str,
    *,
    batch_size_per_rank: int,
    rank: int = 0,
    world_size: int = 1,
    seed: int = 0,
    num_workers: int = 0,
    shuffle: bool = True,
    drop_last: bool = False,
    pin_memory: bool = False,
    resident: "ResidentSplit | None" = None,
    global_padding: bool = False,
) -> tuple["DataLoader | SampledBatches | GloballyPadded", VideoBatchSampler]:
    """A DataLoader of Batches over ``split`` for one DDP rank, and its sampler.

    With ``resident`` (that split, held on a device) the batches are made
    there by index instead: same videos, same values, no loader processes.
    The loader draws its workers' seeds from its own generator, never from
    torch's global one, so both ways leave the training's random stream alike.
    ``global_padding``: each rank's frames and query tokens are padded to the longest
    video and query of the step's global batch (every rank's share), known on every
    rank without communication (:class:`GloballyPadded`).  Call ``sampler.set_epoch(epoch)``
    before each epoch.
    """
    dataset = VideoDataset(collection, split)
    sampler = VideoBatchSampler(
        len(dataset),
        batch_size_per_rank,
        shuffle=shuffle,
        seed=seed,
        rank=rank,
        world_size=world_size,
        drop_last=drop_last,
    )
    if resident is not None:
        if len(resident) != len(dataset):
            raise ValueError(f"the resident split holds {len(resident)} videos, {split!r} has {len(dataset)}")
        batches = SampledBatches(resident.batch, sampler)
        return (GloballyPadded(batches, sampler, dataset) if global_padding else batches), sampler
    loader = DataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=collate,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        pin_memory=pin_memory,
        generator=torch.Generator("cpu").manual_seed(seed),
    )
    if global_padding:
        return GloballyPadded(loader, sampler, dataset), sampler
    return loader, sampler


class GloballyPadded:
    """The batches of ``loader`` (one rank's shares), each with its frames zero-padded to the longest video of
    its step's global batch and its query tokens to the longest query of it, as one process holding the whole
    batch pads it (the reference code's collate functions pad each batch to its longest video and query).
    The lengths come from the split's index and the sampler's order, so no rank waits for another; iterated
    like a DataLoader."""

    def __init__(self, loader: Iterable[Batch], sampler: VideoBatchSampler, dataset: "VideoDataset") -> None:
        self.loader, self.sampler = loader, sampler
        index, collection = dataset.index, dataset.collection
        frames = np.asarray(index.frame_counts, dtype=np.int64)  # (num_videos,)
        self.lengths = np.minimum(frames, collection.max_frames)  # frames each video keeps
        tokens = np.minimum(np.asarray(index.token_counts, dtype=np.int64), collection.max_query_len)  # (Nq,)
        offsets = np.asarray(index.query_offsets, dtype=np.int64)  # (num_videos + 1,)
        self.query_lengths = np.zeros(len(frames), dtype=np.int64)  # each video's longest query
        has = offsets[1:] > offsets[:-1]
        if tokens.size:
            self.query_lengths[has] = np.maximum.reduceat(tokens, offsets[:-1][has])

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Batch]:
        for batch, whole in zip(self.loader, self.sampler.global_batches()):
            padded = batch.pad_frames(int(self.lengths[whole].max())).pad_queries(int(self.query_lengths[whole].max()))
            if padded is not batch and batch.frames.device.type == "cpu" and batch.frames.is_pinned():
                padded = padded.pin_memory()  # as the loader left it: the copy to the device need not wait
            yield padded


class SampledBatches:
    """``make(videos)`` for every list of videos a batch sampler yields; iterated like a DataLoader."""

    def __init__(self, make: Callable[[list[int]], Batch], sampler: Sampler[list[int]]) -> None:
        self.make = make
        self.sampler = sampler

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[Batch]:
        for videos in self.sampler:
            yield self.make(videos)


NORMALIZE_ROWS = 64  # queries of an evaluation batch L2-normalised at once (TVR: a 6 MiB temporary)


class _EvalBatches(Dataset):
    """Item ``k`` is the ``k``-th batch of videos or queries of a split on this rank.

    Videos or queries are taken in split order, or (``by_length``, videos
    only) from the most to the fewest frames, so a batch pads little (and the
    first batch is the largest: the later ones fit in the memory it freed);
    ``longest_batch_first`` (videos only) keeps the batches of the split order
    but yields the one with the longest video first (the others in split order
    of their longest video, most first); the batches of that sequence are dealt
    round-robin over ``world_size`` ranks (batch ``j`` goes to rank
    ``j % world_size``, which balances the lengths).
    """

    def __init__(
        self, dataset: VideoDataset, kind: str, batch_size: int, *, by_length: bool = False,
        rank: int = 0, world_size: int = 1, resident: "ResidentSplit | None" = None, longest_batch_first: bool = False,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank!r}, world_size={world_size!r}")
        if resident is not None and len(resident) != len(dataset):
            raise ValueError(f"the resident split holds {len(resident)} videos, {dataset.index.name!r} has {len(dataset)}")
        self.dataset = dataset
        self.kind = kind
        self.batch_size = batch_size
        self.resident = resident
        index = dataset.index
        total = index.num_videos if kind == "videos" else index.num_queries
        order = np.arange(total, dtype=np.int64)
        counts = np.asarray(index.frame_counts, dtype=np.int64)  # (num_videos,) frames per video, from the index
        if by_length and kind == "videos":
            order = np.argsort(-counts, kind="stable")  # longest first
        batches = [order[lo : lo + batch_size] for lo in range(0, total, batch_size)]
        if longest_batch_first and not by_length and kind == "videos":
            longest = np.array([counts[b].max() for b in batches], dtype=np.int64)  # (num_batches,)
            batches = [batches[j] for j in np.argsort(-longest, kind="stable")]  # the same batches, longest first
        self.batches = batches[rank::world_size]

    def __len__(self) -> int:
        return len(self.batches)

    def _videos(self, items: list[int], ids: list[str]) -> tuple[Tensor, Tensor, Tensor]:
        """``clips (B, Lc, Dv), frames (B, Lf, Dv), frame_mask (B, Lf)`` of videos ``items``, each video
        preprocessed straight into its padded row (its ``min(n, max_frames)`` length known from the
        index): an evaluation batch never holds its videos twice."""
        c = self.dataset.collection
        lengths = np.fromiter((min(c.visual.num_frames(v), c.max_frames) for v in ids), dtype=np.int64, count=len(ids))
        longest = int(lengths.max())
        frames = np.zeros((len(items), longest, c.video_dim), dtype=np.float32)  # (B, Lf, Dv)
        clips = np.empty((len(items), c.num_clips, c.video_dim), dtype=np.float32)  # (B, Lc, Dv)
        for row, i in enumerate(items):
            self.dataset.video(i, frames_out=frames[row, : lengths[row]], clips_out=clips[row])  # (L_i, Dv), (Lc, Dv)
        return torch.from_numpy(clips), torch.from_numpy(frames), prefix_mask(lengths, longest)

    def __getitem__(self, k: int) -> tuple:
        items = self.batches[k].tolist()
        index = self.dataset.index
        ids = [index.video_ids[i] for i in items] if self.kind == "videos" else [index.query_ids[j] for j in items]
        if self.resident is not None:  # the same batch, gathered on the resident split's device
            return (ids, *(self.resident.videos(items) if self.kind == "videos" else self.resident.queries(items)))
        if self.kind == "videos":
            return (ids, *self._videos(items, ids))
        return (ids, *self._queries(items, ids))

    def _queries(self, items: list[int], ids: list[str]) -> tuple[Tensor, Tensor]:
        """``queries (N, Lq, Dq), query_mask (N, Lq)`` of queries ``items``: each read straight into its
        padded row (its ``min(n, max_query_len)`` length known from the index), then L2-normalised
        :data:`NORMALIZE_ROWS` rows at a time (zero padding stays zero): an evaluation batch never holds
        its queries twice, and each token's value is the one :meth:`VideoDataset.query` gives."""
        c = self.dataset.collection
        lengths = np.minimum(self.dataset.index.token_counts[items], c.max_query_len)  # (N,)
        longest = int(lengths.max())
        queries = np.zeros((len(items), longest, c.query_dim), dtype=np.float32)  # (N, Lq, Dq)
        for row, qid in enumerate(ids):
            tokens = c.queries.tokens(qid, max_len=c.max_query_len)  # (Lq_i, Dq), as read
            if tokens.shape[0] != lengths[row]:
                raise ValueError(f"query {qid!r}: {tokens.shape[0]} tokens as read, its index says {lengths[row]}")
            queries[row, : lengths[row]] = tokens
        for lo in range(0, len(items), NORMALIZE_ROWS):
            block = queries[lo : lo + NORMALIZE_ROWS]  # (n, Lq, Dq), a view
            l2_normalize(block, c.normalize, out=block)
        return torch.from_numpy(queries), prefix_mask(lengths, longest)


def _iterate(batches: _EvalBatches, num_workers: int) -> Iterator[tuple]:
    if num_workers == 0 or batches.resident is not None:
        for k in range(len(batches)):
            yield batches[k]
        return
    yield from DataLoader(batches, batch_size=None, shuffle=False, num_workers=num_workers)


def video_batches(
    collection: Collection, split: str, batch_size: int, *, num_workers: int = 0, by_length: bool = False,
    rank: int = 0, world_size: int = 1, resident: "ResidentSplit | None" = None, longest_batch_first: bool = False,
) -> Iterator[tuple[list[str], Tensor, Tensor, Tensor]]:
    """Yield ``(video_ids, clips (B, Lc, Dv), frames (B, Lf, Dv), frame_mask (B, Lf))`` in split order.

    Frames are padded to the longest video of each batch.  ``by_length``:
    videos from the most to the fewest frames instead (little padding);
    ``longest_batch_first``: the split-order batches, the one with the longest
    video first (:class:`_EvalBatches`); ``rank`` / ``world_size``: only this
    rank's batches, dealt round-robin; ``resident`` (that split held on a
    device): the same batches, made there.
    """
    batches = _EvalBatches(
        VideoDataset(collection, split), "videos", batch_size, by_length=by_length, rank=rank, world_size=world_size,
        resident=resident, longest_batch_first=longest_batch_first,
    )
    return _iterate(batches, num_workers)


def query_batches(
    collection: Collection, split: str, batch_size: int, *, num_workers: int = 0, rank: int = 0, world_size: int = 1,
    resident: "ResidentSplit | None" = None,
) -> Iterator[tuple[list[str], Tensor, Tensor]]:
    """Yield ``(query_ids, queries (N, Lq, Dq), query_mask (N, Lq))`` in split order.

    Split order groups queries by video (see :class:`SplitIndex`); tokens are
    padded to the longest query of each batch.  ``rank`` / ``world_size``:
    only this rank's batches, dealt round-robin; ``resident``: made on its device.
    """
    batches = _EvalBatches(
        VideoDataset(collection, split), "queries", batch_size, rank=rank, world_size=world_size, resident=resident
    )
    return _iterate(batches, num_workers)
