"""Retrieval evaluation: encode a split once, rank every query, report R@K.

The pipeline is split into small pieces that work on plain iterables of
batches and on embeddings, so each can be tested without the data layer:

    encode_videos / encode_queries   video / query batches -> VideoEmbedding / QueryEmbedding
    compute_ranks  embeddings -> 1-based rank of each query's video (chunked)
    evaluate       encoding, ranking and the metrics of :mod:`prvrlab.evaluation.metrics`
                   on one split of a data-layer Collection (sharded over DDP ranks
                   when given ``rank`` / ``world_size``)

Tie handling (see ``compute_ranks``): a video scoring exactly as high as the
ground truth is ranked *before* it, so ties never help.  A model whose scores
are constant gets rank ``Nv`` for every query and R@K = 0 (except when
``K >= Nv``), rather than the K/Nv an unstable argsort would hand out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from prvrlab.allocator import release_free_memory
from prvrlab.checks import check_positive_int
from prvrlab.data.batch import mask_to
from prvrlab.evaluation.metrics import DEFAULT_KS, rank_table, recall_at, recall_by_group
from prvrlab.models.base import QueryEmbedding, RetrievalModel, RowBuffer, VideoEmbedding, num_rows, video_tokens
from prvrlab.models.precision import kept_casts, native_low_precision

if TYPE_CHECKING:
    import pyarrow as pa

    from prvrlab.data.resident import ResidentSplit

__all__ = [
    "EvalResult",
    "compute_ranks",
    "encode_queries",
    "encode_videos",
    "evaluate",
    "evaluate_batches",
    "resolve_amp_dtype",
]


VideoBatch = tuple[Sequence[str], Tensor, Tensor, Tensor]  # ids, clips, frames, frame_mask
QueryBatch = tuple[Sequence[str], Tensor, Tensor]  # ids, queries, query_mask


# ---------------------------------------------------------------- small helpers


def saved_model_device(use_gpu: bool, requested: str | torch.device | None = None) -> torch.device:
    """Where a saved model is evaluated or profiled: ``requested``, else CUDA when it was trained on a GPU
    (``train.use_gpu``) and one is visible, else the CPU."""
    if requested is not None:
        return torch.device(requested)
    return torch.device("cuda" if use_gpu and torch.cuda.is_available() else "cpu")


def resolve_amp_dtype(amp: str | torch.dtype | None) -> torch.dtype | None:
    """``"none"``/None -> None, ``"bf16"`` -> bfloat16, ``"fp16"`` -> float16.

    A ``torch.dtype`` is returned unchanged (must be bfloat16 or float16).
    """
    if amp is None:
        return None
    if isinstance(amp, torch.dtype):
        if amp not in (torch.bfloat16, torch.float16):
            raise ValueError(f"amp_dtype must be torch.bfloat16 or torch.float16, got {amp!r}")
        return amp
    names = {"none": None, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
             "fp16": torch.float16, "float16": torch.float16}
    key = str(amp).lower()
    if key not in names:
        raise ValueError(f"amp_dtype must be one of 'none', 'bf16', 'fp16', got {amp!r}")
    return names[key]


def _autocast(device: torch.device, amp_dtype: torch.dtype | None):
    if amp_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=amp_dtype)


def _sync(device: torch.device) -> None:
    """Wait for queued kernels so wall-clock timings mean something on GPUs."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """model.eval() for the duration, restoring the previous mode afterwards."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def _map_tensors(emb, fn):
    """A copy of an embedding dataclass with ``fn`` applied to every tensor (also those in dict fields)."""
    changes: dict[str, Any] = {}
    for f in dataclasses.fields(emb):
        v = getattr(emb, f.name)
        if isinstance(v, Tensor):
            changes[f.name] = fn(v)
        elif isinstance(v, dict):
            changes[f.name] = {k: fn(t) if isinstance(t, Tensor) else t for k, t in v.items()}
    return dataclasses.replace(emb, **changes)


def _float32(emb, keep: tuple[str, ...] = ()):
    """A copy of an embedding dataclass with every floating tensor in float32, except the fields ``keep``
    (``RetrievalModel.low_precision_fields``), left as they are."""
    kept = {name: getattr(emb, name) for name in keep}
    cast = _map_tensors(dataclasses.replace(emb, **dict.fromkeys(kept)),  # the kept fields are not copied
                        lambda t: t.float() if t.is_floating_point() and t.dtype != torch.float32 else t)
    return dataclasses.replace(cast, **kept)


def _stored(emb, fields: tuple[str, ...], amp_dtype: torch.dtype | None):
    """``emb`` with its ``fields`` (``RetrievalModel.low_precision_fields``) in ``amp_dtype`` where they
    are floating tensors of another dtype (an encoder whose last op ran in float32, e.g. GMMFormer's
    clips after their LayerNorms): a bf16 evaluation stores and scores them as bf16 values.  Unchanged
    without ``amp_dtype``."""
    if amp_dtype is None:
        return emb
    tensors = {name: getattr(emb, name) for name in fields}
    cast = {name: t.to(amp_dtype) for name, t in tensors.items()
            if isinstance(t, Tensor) and t.is_floating_point() and t.dtype != amp_dtype}
    return dataclasses.replace(emb, **cast) if cast else emb


def _check_unique(ids: list[str], what: str) -> None:
    if len(set(ids)) != len(ids):
        seen: set[str] = set()
        dup = None
        for i in ids:
            if i in seen:
                dup = i
                break
            seen.add(i)
        raise ValueError(f"{what} {dup!r} was yielded more than once; every {what} must be encoded once")


# ---------------------------------------------------------------- encoding


def encode_videos(
    model: RetrievalModel,
    batches: Iterable[VideoBatch],
    *,
    device: torch.device | str,
    amp_dtype: torch.dtype | str | None = None,
    allow_empty: bool = False,
    release_memory: bool = False,
    rows: int | None = None,
) -> tuple[VideoEmbedding | None, list[str]]:
    """Encode every video once; returns the concatenated embedding and the ids.

    ``batches`` yields ``(video_ids, clips (B,Lc,Dv), frames (B,Lf,Dv),
    frame_mask (B,Lf))``; batches may differ in ``Lf`` (the concatenation
    zero/False-pads it).  Runs under ``torch.inference_mode()`` with the model
    in eval mode; ``amp_dtype`` enables autocast for the encoders only and the
    result is cast back to float32 (the batches' embeddings are kept as encoded
    until then: half the memory under bf16), except the model's
    ``low_precision_fields``, which are stored in the autocast dtype; the fused paths cast their weights
    to that dtype once per call, not once per batch (:func:`~prvrlab.models.precision.kept_casts`).  The
    caller restores the model's mode.
    No batch at all is an error, or ``(None, [])`` with ``allow_empty`` (a
    DDP rank without a share).  ``release_memory``: malloc's free memory is given
    back before the gallery is assembled (see ``evaluate_batches``), so its
    large tensors do not add to the encoders' freed blocks, which they cannot reuse.
    ``rows``: the number of videos the batches yield, where known: each batch is then written into a
    gallery allocated at the first batch (:class:`~prvrlab.models.base.RowBuffer`; yield the longest
    batch first), so the batches are not held beside their concatenation.
    """
    device = torch.device(device)
    amp_dtype = resolve_amp_dtype(amp_dtype)
    low_precision = tuple(getattr(model, "low_precision_fields", ()))
    model.eval()
    gallery = RowBuffer(rows)  # a list of batches concatenated at the end without ``rows``
    ids: list[str] = []
    with torch.inference_mode(), kept_casts(enabled=amp_dtype is not None):  # each weight cast once
        for video_ids, clips, frames, frame_mask in batches:
            if len(video_ids) != clips.shape[0]:
                raise ValueError(f"a video batch has {len(video_ids)} ids but {clips.shape[0]} rows")
            clips = clips.to(device, non_blocking=True)
            frames = frames.to(device, non_blocking=True)
            frame_mask = mask_to(frame_mask, device, non_blocking=True)
            with _autocast(device, amp_dtype):
                emb = model.encode_videos(clips, frames, frame_mask)
            gallery.add(_stored(emb, low_precision, amp_dtype))  # bf16 under bf16 autocast: half the memory
            ids.extend(str(v) for v in video_ids)
            del clips, frames, frame_mask, emb  # freed before the next batch is read
    if not ids:
        if allow_empty:
            return None, []
        raise ValueError("no video batch was yielded; cannot evaluate an empty split")
    _check_unique(ids, "video")
    if release_memory:
        release_free_memory()
    video = gallery.result()
    del gallery  # the float32 copy below is then the only other one (batches concatenated: no part)
    return _float32(video, keep=low_precision), ids


def encode_queries(
    model: RetrievalModel,
    batches: Iterable[QueryBatch],
    *,
    device: torch.device | str,
    amp_dtype: torch.dtype | str | None = None,
    allow_empty: bool = False,
) -> tuple[QueryEmbedding | None, list[str]]:
    """Encode every query; ``batches`` yields ``(query_ids, queries (N,Lq,Dq), query_mask (N,Lq))``.

    Same rules as ``encode_videos`` (inference mode, eval mode, optional
    autocast, float32 result, padded concatenation, ids checked unique,
    ``allow_empty``).
    """
    device = torch.device(device)
    amp_dtype = resolve_amp_dtype(amp_dtype)
    model.eval()
    parts: list[QueryEmbedding] = []
    ids: list[str] = []
    with torch.inference_mode(), kept_casts(enabled=amp_dtype is not None):
        for query_ids, queries, query_mask in batches:
            if len(query_ids) != queries.shape[0]:
                raise ValueError(f"a query batch has {len(query_ids)} ids but {queries.shape[0]} rows")
            queries = queries.to(device, non_blocking=True)
            query_mask = mask_to(query_mask, device, non_blocking=True)
            with _autocast(device, amp_dtype):
                emb = model.encode_queries(queries, query_mask)
            parts.append(_float32(emb))
            ids.extend(str(q) for q in query_ids)
            del queries, query_mask, emb  # freed before the next batch is read
    if not parts:
        if allow_empty:
            return None, []
        raise ValueError("no query batch was yielded; cannot evaluate an empty split")
    _check_unique(ids, "query")
    return QueryEmbedding.cat(parts), ids


# ---------------------------------------------------------------- ranking

# The CPU budgets below were halved in session 39 (scores 128 -> 64, videos 64 -> 32, queries 32 -> 16 MiB):
# the same speed, and with primitive_cache_limit's caps the peak RSS of GMMFormer's evaluation went
# 0.59 -> 0.46 GiB at 2,500 x 500 and 1.04 -> 0.57-0.59 GiB at TVR's test size (docs/performance.md, "Session 39").
SCORE_BUDGET_BYTES = 64 << 20  # float32 scores of one chunk of queries (against every video token)
ENCODE_BUDGET_BYTES = 32 << 20  # float32 input features (clips + frames) of one batch of videos encoded on the CPU
DEVICE_ENCODE_BUDGET_BYTES = 128 << 20  # the same, encoded on an accelerator (its working set is in device memory)
QUERY_BUDGET_BYTES = 16 << 20  # float32 word features of one batch of queries


def _available_bytes() -> int:
    """Free physical memory (bytes), or a large number where the OS does not say."""
    from prvrlab.data.resident import available_bytes

    free = available_bytes(torch.device("cpu"))
    return 1 << 40 if free is None else free


def video_batch_size(
    configured: int, tokens_per_video: int, video_dim: int, *, on_cpu: bool = True, share: float = 1.0
) -> int:
    """Videos to encode at once: ``configured``, lowered so that a batch's float32 input features
    (``tokens_per_video`` clip and frame rows of ``video_dim``) fit min(:data:`ENCODE_BUDGET_BYTES`,
    1/16 of the free memory); the encoders' working set is a few times their input (the padded batch,
    its packed and normalised copies, the attention maps).  TVR (3,072-d, 32 clips + 128 frames):
    17 videos at a time.  Encoded on an accelerator (``on_cpu`` false), the host holds only the
    batch: :data:`DEVICE_ENCODE_BUDGET_BYTES` (TVR: 68 videos).  ``share``: the part of the CPU budget
    the model's encoders may take (:meth:`~prvrlab.models.base.RetrievalModel.encode_budget_share`:
    GMMFormer v2's 8 branches, 0.5: 8 TVR videos)."""
    budget = int(ENCODE_BUDGET_BYTES * share) if on_cpu else DEVICE_ENCODE_BUDGET_BYTES
    return _fitting(configured, 4 * tokens_per_video * video_dim, budget)


def query_batch_size(configured: int, max_words: int, query_dim: int) -> int:
    """Queries to encode at once: ``configured``, lowered so that a batch's float32 word features
    (``max_words`` rows of ``query_dim``) fit min(:data:`QUERY_BUDGET_BYTES`, 1/16 of the free memory).
    TVR (768-d, 30 words): 182 queries instead of 1,024; the query phase of an evaluation at TVR's test
    size held 0.65 GiB above the gallery with 1,024 (half as much with 256-384, no slower)."""
    return _fitting(configured, 4 * max_words * query_dim, QUERY_BUDGET_BYTES)


def _fitting(configured: int, item_bytes: int, budget_bytes: int) -> int:
    """``configured`` items, fewer where ``item_bytes`` each exceed min(``budget_bytes``, free memory / 16);
    at least 1."""
    budget = min(budget_bytes, _available_bytes() // 16)
    return max(1, min(int(configured), budget // max(1, item_bytes)))


def score_chunk(video_emb: VideoEmbedding, chunk: int, *, elements: int | None = None) -> int:
    """Queries to score at once: ``chunk``, lowered so that ``elements`` float32 values per query (what
    the model's scoring holds at once, :meth:`RetrievalModel.score_elements`; by default one score per
    (query, video token) of every embedding tensor of ``video_emb``: its ``(Nv, ..., D)`` rows, all
    branches) fit min(:data:`SCORE_BUDGET_BYTES`, 1/8 of the free memory).  E.g. a backbone scoring
    every token of TVR's test size (2,179 videos x (32 clips + 128 frames)) would score 48 queries at a
    time instead of 2,048 (a 2.9 GB score matrix); GMMFormer and v2 declare 8 values a video
    (:func:`~prvrlab.models.scoring.indexed_score_elements`): 962.  Ranks do not depend on the chunk."""
    per_query = video_tokens(video_emb) if elements is None else int(elements)
    budget = min(SCORE_BUDGET_BYTES, _available_bytes() // 8)
    return max(1, min(int(chunk), budget // max(1, 4 * per_query)))


def compute_ranks(
    model: RetrievalModel,
    query_emb: QueryEmbedding,
    video_emb: VideoEmbedding,
    query_video: np.ndarray | Tensor | Sequence[int],
    *,
    chunk: int,
    release_memory: bool = False,
) -> np.ndarray:
    """1-based rank of each query's ground-truth video among all videos.

    Scores ``chunk`` queries against ALL videos at a time with
    ``model.fuse(model.score(...))`` (float32), so at most a
    ``(chunk, Nv)`` score matrix exists at once; the ground-truth score is
    gathered per row and compared with the whole row, without any Python loop
    over queries or videos.

    ``query_video[i]`` is the index (into the videos of ``video_emb``) of query
    ``i``'s relevant video.

    Ties count AGAINST the ground truth::

        rank = 1 + #(videos scoring strictly higher)
                 + #(other videos scoring exactly the same)

    i.e. the ground truth is placed last among the videos it ties with.  The
    reference implementations rank with an unstable argsort, where ties fall
    back to gallery order and can help the ground truth (an untrained model
    with constant scores then gets R@K ~ K/Nv); here constant scores give
    rank ``Nv`` for every query.  NaN scores are treated as ``-inf`` (a NaN
    ground truth is tied with every other NaN/``-inf`` score, hence ranked
    last among them).

    ``release_memory``: malloc's free memory goes back to the system after every chunk (see
    ``evaluate_batches``): a chunk's blocks, placed in the free memory the earlier phases left, would
    otherwise leave those pages resident (v2 at TVR's test size: +0.15 GiB over 12 chunks, +0.1 with it).

    Returns an int64 array of shape (Nq,), values in [1, Nv].
    """
    check_positive_int(chunk, "chunk")
    num_queries = num_rows(query_emb)
    num_videos = num_rows(video_emb)
    if isinstance(query_video, Tensor):
        qv = query_video.detach().to("cpu", torch.long).reshape(-1)
    else:
        qv = torch.as_tensor(np.asarray(query_video), dtype=torch.long).reshape(-1)
    if qv.numel() != num_queries:
        raise ValueError(f"query_video has {qv.numel()} entries but there are {num_queries} queries")
    if num_queries and (int(qv.min()) < 0 or int(qv.max()) >= num_videos):
        raise ValueError(
            f"query_video values must lie in [0, {num_videos - 1}], got range "
            f"[{int(qv.min())}, {int(qv.max())}]"
        )

    ranks = np.empty(num_queries, dtype=np.int64)
    with _eval_mode(model), torch.inference_mode():
        video_emb = model.index_videos(video_emb)  # what every query chunk reuses
        for start in range(0, num_queries, chunk):
            stop = min(start + chunk, num_queries)
            query_part = query_emb.index(slice(start, stop))
            scores = model.fuse(model.score(query_part, video_emb)).float()  # (n, Nv)
            if scores.shape != (stop - start, num_videos):
                raise ValueError(
                    f"model.fuse returned shape {tuple(scores.shape)}, expected {(stop - start, num_videos)}"
                )
            scores = torch.where(torch.isnan(scores), torch.full_like(scores, float("-inf")), scores)
            target = qv[start:stop].to(scores.device).unsqueeze(1)  # (n, 1)
            gt = scores.gather(1, target)  # (n, 1)
            higher = (scores > gt).sum(dim=1)
            tied_others = (scores == gt).sum(dim=1) - 1  # the ground truth ties with itself
            ranks[start:stop] = (1 + higher + tied_others).cpu().numpy()
            del scores, gt, higher, tied_others, query_part
            if release_memory:
                release_free_memory()
    return ranks


# ---------------------------------------------------------------- end to end


@dataclass
class EvalResult:
    """The outcome of evaluating one split.

    ``metrics``: r1, r5, r10, r100, sumr (percent).  ``by_group``: per ratio
    group metrics + count, or None when the split has no ratios.  ``ranks``:
    int64 (Nq,), row ``i`` the rank of query ``query_ids[i]``, whose video is
    ``query_video_ids[i]`` and moment/video ratio ``ratios[i]`` (None without
    ratios): the rows of :attr:`table`.  ``seconds``: total wall time;
    ``timings``: its parts (encode_videos, encode_queries, score).
    """

    metrics: dict[str, float]
    by_group: dict[str, dict[str, float]] | None
    ranks: np.ndarray
    query_ids: list[str]
    query_video_ids: list[str]
    ratios: np.ndarray | None
    num_queries: int
    num_videos: int
    seconds: float
    timings: dict[str, float] = field(default_factory=dict)

    @functools.cached_property
    def table(self) -> pa.Table:
        """The per-query rank table (:func:`~prvrlab.evaluation.metrics.rank_table`), made on first use:
        pyarrow is loaded then, not while the evaluation runs."""
        return rank_table(self.query_ids, self.query_video_ids, self.ranks, self.ratios)

    def flat(self, prefix: str = "") -> dict[str, float]:
        """Metrics as one flat mapping for logging: ``{prefix}r1``,
        ``{prefix}short/r1``, ``{prefix}short/count``, ..."""
        out = {f"{prefix}{k}": float(v) for k, v in self.metrics.items()}
        for group, metrics in (self.by_group or {}).items():
            out.update({f"{prefix}{group}/{k}": float(v) for k, v in metrics.items()})
        return out


def _permutation(yielded: list[str], expected: Sequence[str], what: str) -> np.ndarray | None:
    """Index into ``expected`` of every yielded id (None when already equal)."""
    expected = [str(e) for e in expected]
    if yielded == expected:
        return None
    position = {e: i for i, e in enumerate(expected)}
    missing = [y for y in yielded if y not in position]
    if missing or len(yielded) != len(expected):
        extra = f"; e.g. {missing[0]!r} is not in the split" if missing else ""
        raise ValueError(
            f"the {what} batches yielded {len(yielded)} ids, the split lists {len(expected)}{extra}"
        )
    return np.fromiter((position[y] for y in yielded), dtype=np.int64, count=len(yielded))


def _positions(yielded: list[str], expected: Sequence[str], what: str) -> np.ndarray:
    """Index into ``expected`` of every yielded id (raises on an id not in ``expected``)."""
    position = {str(e): i for i, e in enumerate(expected)}
    missing = [y for y in yielded if y not in position]
    if missing:
        raise ValueError(f"the {what} batches yielded {missing[0]!r}, which is not in the split")
    return np.fromiter((position[y] for y in yielded), dtype=np.int64, count=len(yielded))


def _all_gather(obj: Any, world_size: int) -> list[Any]:
    """Every rank's ``obj``, in rank order (``[obj]`` in a single process)."""
    if world_size == 1:
        return [obj]
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() != world_size:
        raise ValueError(f"world_size={world_size} needs an initialised process group of that size")
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, obj)
    return gathered


def evaluate_batches(
    model: RetrievalModel,
    video_batches_iter: Iterable[VideoBatch],
    query_batches_iter: Iterable[QueryBatch],
    *,
    video_ids: Sequence[str],
    query_ids: Sequence[str],
    query_video: np.ndarray | Sequence[int],
    ratios: np.ndarray | Sequence[float] | None = None,
    chunk: int = 2048,
    device: torch.device | str = "cpu",
    amp_dtype: torch.dtype | str | None = None,
    ks: Sequence[int] = DEFAULT_KS,
    rank: int = 0,
    world_size: int = 1,
    split_order: bool = False,
    release_memory: bool = False,
) -> EvalResult | None:
    """``evaluate`` without the data layer: batches plus the split's index.

    ``video_ids`` / ``query_ids`` / ``query_video`` / ``ratios`` describe the
    split (``query_video[i]`` indexes ``video_ids``).  The batches may yield
    videos and queries in any order, but each exactly once; results (ranks,
    table rows) follow the order in which queries were yielded, or the split's
    order with ``split_order``.

    Sharded over DDP ranks (``world_size`` > 1, a process group initialised):
    every rank passes its own share of the batches, each video and query on
    exactly one rank.  The video embeddings are gathered on every rank, each
    rank scores its own queries against all videos, and rank 0 gathers the
    ranks and returns the result (in the order of the ranks' yields, rank by
    rank, unless ``split_order``); the other ranks return None.  Every rank
    must call this.

    ``release_memory``: give malloc's free memory back to the system between the video, query and
    scoring phases (:func:`~prvrlab.allocator.release_free_memory`, under the ``keep`` host
    allocator), so one phase's freed blocks are not resident under the next: for a process that
    only evaluates (``prvrlab eval``).  A training process leaves it off: its training working set
    is larger than an evaluation's, and the next step would fault those pages in again.
    """
    check_positive_int(world_size, "world_size")
    if not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank!r}, world_size={world_size!r}")
    device = torch.device(device)
    query_video = np.asarray(query_video, dtype=np.int64)
    if query_video.shape != (len(query_ids),):
        raise ValueError(f"query_video has shape {query_video.shape}, expected ({len(query_ids)},)")
    timings: dict[str, float] = {}
    t_start = time.perf_counter()
    with _eval_mode(model):
        t0 = time.perf_counter()
        sharded = world_size > 1  # a rank may have no share
        video_emb, yielded_videos = encode_videos(
            model, video_batches_iter, device=device, amp_dtype=amp_dtype, allow_empty=sharded,
            release_memory=release_memory, rows=None if sharded else len(video_ids),
        )
        if sharded:  # every rank scores against all videos
            shares = _all_gather((None if video_emb is None else _map_tensors(video_emb, Tensor.cpu), yielded_videos), world_size)
            parts = [emb for emb, _ in shares if emb is not None]
            if not parts:
                raise ValueError("no video batch was yielded on any rank; cannot evaluate an empty split")
            video_emb = VideoEmbedding.cat(parts).to(device)
            yielded_videos = [v for _, ids in shares for v in ids]
            _check_unique(yielded_videos, "video")
        _sync(device)
        if release_memory:  # the encoders' freed blocks: not resident while queries are encoded
            release_free_memory()
        timings["encode_videos"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        query_emb, yielded_queries = encode_queries(
            model, query_batches_iter, device=device, amp_dtype=amp_dtype, allow_empty=sharded
        )
        _sync(device)
        if release_memory:
            release_free_memory()
        timings["encode_queries"] = time.perf_counter() - t0

        # Align the split's index with the order in which things were encoded.
        video_perm = _permutation(yielded_videos, video_ids, "video")  # yielded row -> split index
        query_pos = _positions(yielded_queries, query_ids, "query")  # this rank's queries -> split index
        row_of_split_video = np.arange(len(video_ids), dtype=np.int64)
        if video_perm is not None:
            row_of_split_video[video_perm] = np.arange(len(video_perm), dtype=np.int64)
        qv_rows = row_of_split_video[query_video[query_pos]]

        t0 = time.perf_counter()
        ranks = np.empty(0, dtype=np.int64)
        if query_emb is not None:
            with torch.inference_mode():  # indexed here so that the plain gallery can be let go
                video_emb = model.index_videos(video_emb)
            if release_memory:  # the plain gallery's fields that indexing replaced (e.g. by bf16 copies)
                release_free_memory()
            at_once = score_chunk(video_emb, chunk, elements=model.score_elements(video_emb))
            ranks = compute_ranks(model, query_emb, video_emb, qv_rows, chunk=at_once, release_memory=release_memory)
        _sync(device)
        timings["score"] = time.perf_counter() - t0

    if sharded:  # rank 0 collects every rank's queries and ranks
        shares = _all_gather((yielded_queries, ranks), world_size)
        if rank != 0:
            return None
        yielded_queries = [q for ids, _ in shares for q in ids]
        ranks = np.concatenate([r for _, r in shares])
    if not yielded_queries:
        raise ValueError("no query batch was yielded; cannot evaluate an empty split")
    _check_unique(yielded_queries, "query")
    query_perm = _permutation(yielded_queries, query_ids, "query")  # every query exactly once
    if query_perm is None:
        query_perm = np.arange(len(query_ids), dtype=np.int64)
    if split_order:
        order = np.argsort(query_perm)
        yielded_queries, ranks, query_perm = [yielded_queries[i] for i in order], ranks[order], query_perm[order]
    query_ratios = None if ratios is None else np.asarray(ratios, dtype=np.float64)[query_perm]
    split_video_ids = [str(v) for v in video_ids]
    seconds = time.perf_counter() - t_start
    timings["total"] = seconds
    return EvalResult(
        metrics=recall_at(ranks, ks),
        by_group=None if query_ratios is None else recall_by_group(ranks, query_ratios, ks),
        ranks=ranks,
        query_ids=yielded_queries,  # str already (encode_queries)
        query_video_ids=[split_video_ids[i] for i in query_video[query_perm]],
        ratios=query_ratios,
        num_queries=len(ranks),
        num_videos=len(yielded_videos),
        seconds=seconds,
        timings=timings,
    )


def evaluate(
    model: RetrievalModel,
    collection: Any,
    split: str,
    eval_cfg: Any,
    *,
    device: torch.device | str,
    amp_dtype: torch.dtype | str | None = None,
    rank: int = 0,
    world_size: int = 1,
    resident: "ResidentSplit | None" = None,
    release_memory: bool = False,
) -> EvalResult | None:
    """Evaluate ``model`` on ``split`` of a data-layer ``Collection``; rows in the split's query order.

    Videos are encoded at most ``eval_cfg.video_batch_size`` at a time (fewer
    where their features would not fit the budget of :func:`video_batch_size`),
    from the most to the fewest frames (little padding, and each batch fits in the memory the
    first one freed; a backbone's scores never depend on a batch's padding), or, for a model whose
    videos' encodings depend on their batch (``RetrievalModel.batch_dependent_videos``), in the batches
    the reference code evaluates: split order, exactly ``eval_cfg.video_batch_size`` a batch (the batch
    with the longest video encoded first, so the gallery is allocated once); queries
    ``eval_cfg.query_batch_size`` at a time (fewer where their features would not fit the budget of
    :func:`query_batch_size`), and at most ``eval_cfg.score_chunk`` queries (fewer where their
    scores would not fit the memory budget of :func:`score_chunk`) are scored
    against all videos at once (see ``compute_ranks`` for the tie rule).  ``amp_dtype``
    (``"bf16"``, ``torch.bfloat16``, ...) enables autocast for encoding only;
    scores and metrics are float32.  On a CPU without native bf16 matrix units
    (where bf16 products are emulated and tens of times slower) bf16 falls
    back to float32, with one warning.  ``rank`` / ``world_size``: encoding
    and scoring sharded over DDP ranks (see ``evaluate_batches``; rank 0
    returns the result, the others None).  ``resident``: the split held on
    the device (``data.resident``), whose batches are the same, made there.
    ``release_memory``: see ``evaluate_batches``.
    The model's train/eval mode is restored afterwards.
    """
    from prvrlab.data.dataset import query_batches, video_batches

    dev = torch.device(device)
    amp = resolve_amp_dtype(amp_dtype)
    if amp is not None and not native_low_precision(dev.type):
        _warn_emulated(amp)
        amp = None
    index = collection.split(split)
    ratios = getattr(index, "ratios", None)
    shard = {"rank": rank, "world_size": world_size}
    batch, queries_at_once = int(eval_cfg.video_batch_size), int(eval_cfg.query_batch_size)
    as_reference = model.batch_dependent_videos()  # the reference's batches: split order, exactly video_batch_size
    if hasattr(collection, "max_frames") and not as_reference:
        batch = video_batch_size(batch, collection.max_frames + collection.num_clips, collection.video_dim,
                                 on_cpu=dev.type == "cpu", share=model.encode_budget_share())
    if hasattr(collection, "max_query_len"):
        queries_at_once = query_batch_size(queries_at_once, collection.max_query_len, collection.query_dim)
    if world_size > 1:  # the ranks deal out the same batches only when they cut the split alike: the smallest fit
        fits = _all_gather((batch, queries_at_once), world_size)
        batch, queries_at_once = min(f[0] for f in fits), min(f[1] for f in fits)
    return evaluate_batches(
        model,
        video_batches(collection, split, batch, by_length=not as_reference, longest_batch_first=as_reference,
                      resident=resident, **shard),
        query_batches(collection, split, queries_at_once, resident=resident, **shard),
        video_ids=index.video_ids,
        query_ids=index.query_ids,
        query_video=index.query_video,
        ratios=ratios,
        chunk=int(eval_cfg.score_chunk),
        device=dev,
        amp_dtype=amp,
        split_order=True,
        release_memory=release_memory,
        **shard,
    )


@functools.lru_cache(maxsize=None)
def _warn_emulated(amp: torch.dtype) -> None:
    warnings.warn(
        f"evaluation: {amp} autocast requested, but this CPU has no native bf16 matrix units "
        "(AMX / AVX512-BF16); evaluating in float32, which is faster here",
        RuntimeWarning,
        stacklevel=3,
    )
