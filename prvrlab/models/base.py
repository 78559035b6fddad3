"""The contract every backbone fulfils, and the typed objects it returns.

A backbone encodes videos and queries separately (so evaluation encodes each
video once) and scores any set of queries against any set of videos, per
*branch* (e.g. ``"clip"`` and ``"frame"``).  The final retrieval score is the
weighted sum of the branch similarities with ``score_weights``.

A backbone also declares the capabilities it can supply to losses and
plug-ins (``provides``, names from :mod:`prvrlab.models.component`) and
supplies each one only when it is requested for the current mode
(``request`` / ``exposes``), so retrieval keeps no tensor that only
training reads.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from prvrlab.data.batch import Batch
from prvrlab.models.component import FRAME_TOKENS, MOMENT_TOKENS, WORD_TOKENS, check_capabilities
from prvrlab.models.initialization import init_normal_


def _map_value(v: Any, fn):
    if isinstance(v, Tensor):
        return fn(v)
    if is_dataclass(v) and not isinstance(v, type):
        return _map_tensors(v, fn)
    return v


def _map_tensors(obj, fn):
    """Apply ``fn`` to every Tensor of a dataclass: its fields, its dict fields and nested
    embeddings in them (e.g. a plug-in's second encoder's ``VideoEmbedding`` in ``extra``)."""
    changes = {}
    for f in fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, dict):
            changes[f.name] = {k: _map_value(t, fn) for k, t in v.items()}
        else:
            changes[f.name] = _map_value(v, fn)
    return replace(obj, **changes)


def tensors_of(obj) -> list[Tensor]:
    """Every Tensor of an embedding dataclass, nested ones included (see :func:`_map_tensors`)."""
    found: list[Tensor] = []
    _map_tensors(obj, lambda t: found.append(t) or t)
    return found


def num_rows(emb) -> int:
    """The first dimension every tensor of an embedding dataclass shares (nested ones included)."""
    sizes = {int(t.shape[0]) for t in tensors_of(emb)}
    if not sizes:
        raise ValueError(f"{type(emb).__name__} holds no tensor")
    if len(sizes) > 1:
        raise ValueError(f"{type(emb).__name__} tensors disagree on their first dimension: {sorted(sizes)}")
    return sizes.pop()


def video_tokens(video) -> int:
    """Rows of every float (Nv, ..., D) tensor of an embedding: one per video, clip or frame token."""
    return sum(t.numel() // t.shape[-1] for t in tensors_of(video) if t.is_floating_point() and t.dim() >= 2)


def _ones_mask(tokens: Tensor) -> Tensor:
    return torch.ones(tokens.shape[:2], dtype=torch.bool, device=tokens.device)


@dataclass
class VideoEmbedding:
    """Encoded videos; every tensor has the video index as its first dimension.

    ``clip``: (Nv, Lc, D) clip-level (moment) embeddings.  ``frame``: (Nv, D)
    pooled or (Nv, Lf, D) per-frame embeddings with ``frame_mask`` (Nv, Lf).
    ``extra`` holds backbone- or plug-in-specific per-video values (tensors
    with first dim Nv, or nested embeddings such as a second encoder's);
    plug-in entries are named ``"<plugin>.<key>"``.  Components read the
    capabilities through :meth:`frame_tokens` and :meth:`moment_tokens`.
    """

    clip: Tensor | None = None
    frame: Tensor | None = None
    frame_mask: Tensor | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def frame_tokens(self) -> tuple[Tensor, Tensor]:
        """Per-frame embeddings (Nv, Lf, D) and their (Nv, Lf) bool mask (capability ``frame_tokens``).

        From ``extra['frame_tokens']`` / ``extra['frame_mask']`` (backbones whose
        ``frame`` is pooled put them there when the capability is requested),
        else from a per-frame ``frame`` with ``frame_mask``.
        """
        if "frame_tokens" in self.extra:
            tokens, mask = self.extra["frame_tokens"], self.extra.get("frame_mask")
        elif self.frame is not None and self.frame.dim() == 3:
            tokens, mask = self.frame, self.frame_mask
        else:
            raise ValueError(
                "no per-frame embeddings in this VideoEmbedding: the backbone must provide and be asked for "
                f"'{FRAME_TOKENS}' (a component's needs() requests it)"
            )
        return tokens, (_ones_mask(tokens) if mask is None else mask.to(torch.bool))

    def moment_tokens(self) -> tuple[Tensor, Tensor]:
        """Moment/clip-level embeddings (Nv, M, D) and their (Nv, M) bool mask (capability ``moment_tokens``)."""
        if "moment_tokens" in self.extra:
            tokens, mask = self.extra["moment_tokens"], self.extra.get("moment_mask")
        elif self.clip is not None and self.clip.dim() == 3:
            tokens, mask = self.clip, None
        else:
            raise ValueError(f"no moment embeddings in this VideoEmbedding (capability '{MOMENT_TOKENS}')")
        return tokens, (_ones_mask(tokens) if mask is None else mask.to(torch.bool))

    def to(self, device: torch.device | str) -> "VideoEmbedding":
        return _map_tensors(self, lambda t: t.to(device))

    def detach(self) -> "VideoEmbedding":
        return _map_tensors(self, lambda t: t.detach())

    def index(self, idx: Tensor | slice) -> "VideoEmbedding":
        """The embeddings of a subset of videos (first-dimension indexing)."""
        return _map_tensors(self, lambda t: t[idx])

    @staticmethod
    def cat(parts: list["VideoEmbedding"]) -> "VideoEmbedding":
        """Concatenate along videos, zero/False-padding dim 1 where lengths differ."""
        return _cat(parts)


@dataclass
class QueryEmbedding:
    """Encoded queries; every tensor has the query index as its first dimension.

    ``vectors`` maps a branch name to its (Nq, D) query vector (a backbone may
    use one shared vector for all branches).  ``tokens`` (Nq, Lq, D) and
    ``token_mask`` (Nq, Lq) keep the word-level encodings (capability
    ``word_tokens``, read through :meth:`word_tokens`).  ``own_video`` (Nq,)
    long: each query's video among the videos it is scored against, set by
    the training forward (the batch's ``query_video``); None in retrieval.
    """

    vectors: dict[str, Tensor] = field(default_factory=dict)
    tokens: Tensor | None = None
    token_mask: Tensor | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    own_video: Tensor | None = None

    def word_tokens(self) -> tuple[Tensor, Tensor]:
        """Per-word embeddings (Nq, Lq, D) and their (Nq, Lq) bool mask (capability ``word_tokens``)."""
        if self.tokens is None:
            raise ValueError(f"no per-word embeddings in this QueryEmbedding (capability '{WORD_TOKENS}')")
        mask = self.token_mask
        return self.tokens, (_ones_mask(self.tokens) if mask is None else mask.to(torch.bool))

    def to(self, device: torch.device | str) -> "QueryEmbedding":
        return _map_tensors(self, lambda t: t.to(device))

    def detach(self) -> "QueryEmbedding":
        return _map_tensors(self, lambda t: t.detach())

    def index(self, idx: Tensor | slice) -> "QueryEmbedding":
        return _map_tensors(self, lambda t: t[idx])

    @staticmethod
    def cat(parts: list["QueryEmbedding"]) -> "QueryEmbedding":
        return _cat(parts)


def _cat_values(values: list[Any]) -> Any:
    first = values[0]
    if isinstance(first, Tensor):
        return _pad_cat(values)
    if is_dataclass(first) and not isinstance(first, type):
        return _cat(values)
    return first


def _cat(parts):
    first = parts[0]
    changes = {}
    for f in fields(first):
        v = getattr(first, f.name)
        if isinstance(v, dict):
            changes[f.name] = {k: _cat_values([getattr(p, f.name)[k] for p in parts]) for k in v}
        else:
            changes[f.name] = _cat_values([getattr(p, f.name) for p in parts])
    return replace(first, **changes)


def _pad_cat(tensors: list[Tensor]) -> Tensor:
    """``torch.cat`` along dim 0 (with its type promotion), zero/False-padding dim 1 to the longest;
    each part is copied once into the result (no padded copy of every part beside it)."""
    first = tensors[0]
    if first.dim() < 2 or all(t.shape[1:] == first.shape[1:] for t in tensors):
        return torch.cat(tensors, dim=0)
    if any(t.dim() != first.dim() or t.shape[2:] != first.shape[2:] for t in tensors):
        raise ValueError(f"cannot concatenate tensors of shapes {sorted({tuple(t.shape) for t in tensors})}")
    dtype = functools.reduce(torch.promote_types, (t.dtype for t in tensors))
    out = first.new_zeros((sum(t.shape[0] for t in tensors), max(t.shape[1] for t in tensors), *first.shape[2:]), dtype=dtype)
    row = 0
    for t in tensors:
        out[row : row + t.shape[0], : t.shape[1]] = t
        row += t.shape[0]
    return out


def _fits(out: Any, part: Any) -> bool:
    """Whether every tensor of ``part`` can be written into its counterpart in ``out`` (same structure,
    dtype and trailing shape; dim 1 at most as long: the rest stays zero/False padding)."""
    if isinstance(part, Tensor):
        return (
            isinstance(out, Tensor) and out.dtype == part.dtype and out.device == part.device
            and out.dim() == part.dim() and out.shape[2:] == part.shape[2:]
            and (part.dim() < 2 or part.shape[1] <= out.shape[1])
        )
    if isinstance(part, dict):
        return isinstance(out, dict) and out.keys() == part.keys() and all(_fits(out[k], t) for k, t in part.items())
    if is_dataclass(part) and not isinstance(part, type):
        return type(out) is type(part) and all(_fits(getattr(out, f.name), getattr(part, f.name)) for f in fields(part))
    return not isinstance(out, (Tensor, dict))


class RowBuffer:
    """``_cat`` of embedding parts (``VideoEmbedding.cat``) written into tensors allocated once for
    ``rows`` rows, so no part is held beside the result: a gallery assembled batch by batch peaks at
    the gallery plus one batch instead of twice the gallery.  The first part sets each tensor's dtype
    and dim-1 length (encode the longest batch first: a shorter one is zero/False-padded); a part that
    does not fit (longer, another dtype or structure, rows beyond ``rows``), or ``rows`` None, makes it
    a list of parts concatenated at the end.  :meth:`result` equals ``_cat`` of the parts, bit for bit."""

    def __init__(self, rows: int | None) -> None:
        self.rows, self.filled = (0 if rows is None else int(rows)), 0
        self.out: Any = None
        self.parts: list[Any] | None = [] if rows is None else None  # the fallback

    def add(self, part: Any) -> None:
        """Append ``part``'s rows."""
        if self.parts is None:
            n = num_rows(part)
            if self.out is None:
                self.out = _map_tensors(part, lambda t: t.new_zeros((self.rows, *t.shape[1:])))
            if self.filled + n <= self.rows and _fits(self.out, part):
                for out, t in zip(tensors_of(self.out), tensors_of(part)):  # the same structure: the same order
                    rows = out[self.filled : self.filled + n]
                    (rows if t.dim() < 2 else rows[:, : t.shape[1]]).copy_(t)
                self.filled += n
                return
            self.parts = [_map_tensors(self.out, lambda t: t[: self.filled])] if self.filled else []
            self.out = None
        self.parts.append(part)

    def result(self) -> Any:
        """Every part's rows (None when nothing was added)."""
        if self.parts is not None:
            return _cat(self.parts) if self.parts else None
        if self.out is None or self.filled == self.rows:
            return self.out
        return _map_tensors(self.out, lambda t: t[: self.filled])


@dataclass
class BranchScores:
    """Scores of one branch for every (query, video) pair.

    ``sim``: (Nq, Nv) cosine similarities used for ranking and triplet losses.
    ``logits``: (Nq, Nv) unnormalised dot products used by InfoNCE (None when a
    backbone has no such notion; losses needing it then raise).
    ``targets``: None when the columns are the scored videos (query i's
    positive is its video's column, the batch's ``query_video``); otherwise
    (Nq,) long, the column of each query's one positive, for training scores
    whose columns are something else (MS-SL's official frame branch: (Nq, Nq),
    column j the vector query j attends in its own video; targets 0..Nq-1).
    """

    sim: Tensor
    logits: Tensor | None = None
    targets: Tensor | None = None


@dataclass
class BatchEncoding:
    """A training batch's encodings before anything compares its rows: each tensor holds one row per
    video or query, so DDP ranks can gather them into the global batch's (``train.ddp_batch: global``)."""

    query: QueryEmbedding
    video: VideoEmbedding
    redrawn: QueryEmbedding | None = None  # the queries encoded a second time (``query_redraw``)


@dataclass
class ModelOutput:
    """What ``RetrievalModel.forward`` returns for a training batch."""

    scores: dict[str, BranchScores]  # branch name -> (Nq, B) scores
    query: QueryEmbedding
    video: VideoEmbedding
    aux: dict[str, Any] = field(default_factory=dict)  # plug-in training extras, "<plugin>.<key>"
    batch: Batch | None = None  # the batch the scores span (the global one under train.ddp_batch: global)


def rename_legacy_keys(state_dict: dict[str, Any], prefix: str, renames: Mapping[str, str]) -> None:
    """Rename in place every key ``prefix + old + rest`` to ``prefix + new + rest``, for each ``old`` ->
    ``new`` key prefix of ``renames``.  A key whose new name is already taken stays as it is (strict
    loading then reports it as unexpected)."""
    for key in [k for k in state_dict if k.startswith(prefix)]:
        rest = key[len(prefix) :]
        for old, new in renames.items():
            if rest.startswith(old):
                target = prefix + new + rest[len(old) :]
                if target not in state_dict:
                    state_dict[target] = state_dict.pop(key)
                break


def check_shared_entries(model: nn.Module, state_dict: Mapping[str, Any]) -> None:
    """Raise RuntimeError when keys that name one tensor of ``model`` (a module shared by two owners)
    hold different values in ``state_dict``: the file was written by a model where they were separate,
    and loading it would keep whichever came last."""
    groups: dict[int, list[str]] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if isinstance(value, Tensor) and key in state_dict:
            groups.setdefault(id(value), []).append(key)
    for keys in groups.values():
        first = state_dict[keys[0]]
        for other in keys[1:]:
            if not (state_dict[other].shape == first.shape and torch.equal(state_dict[other], first)):
                raise RuntimeError(
                    f"{keys[0]!r} and {other!r} are one shared tensor in this model but differ in the weights "
                    "loaded (written by a model where they were separate)"
                )


def set_activation_checkpointing(module: nn.Module, enabled: bool) -> int:
    """Set ``checkpoint_activations`` on every submodule that declares it (``train.checkpoint_activations``).

    A module that declares the attribute recomputes its memory-heavy
    activations in the backward instead of keeping them (same results, less
    memory, more time).  Returns how many modules were switched.
    """
    count = 0
    for sub in module.modules():
        if hasattr(sub, "checkpoint_activations"):
            sub.checkpoint_activations = bool(enabled)
            count += 1
    return count


class RetrievalModel(nn.Module):
    """Base class of every backbone.

    Subclasses implement ``encode_videos``, ``encode_queries`` and ``score``;
    ``forward`` (training) and ``fuse`` (retrieval score) come from here.
    ``score_weights`` maps each branch to its weight in the final score.
    ``legacy_keys`` maps the state-dict key prefixes of a backbone's earlier
    module layouts to the current ones: ``load_state_dict`` renames them, so
    checkpoints written before a layout change keep loading.
    ``low_precision_fields`` names the VideoEmbedding fields that ``index_videos``
    and ``score`` take in any float dtype: an evaluation under autocast stores them
    in its dtype (bf16 under bf16 autocast, rounded where the encoder's last op ran
    in float32) instead of casting the gallery to float32.
    """

    score_weights: dict[str, float]
    # Capabilities this backbone can supply (names from prvrlab.models.component).
    provides: ClassVar[frozenset[str]] = frozenset()
    legacy_keys: ClassVar[Mapping[str, str]] = {}
    # Parameter values of the ``corrected`` preset (``--preset corrected``): prvrlab's corrected behaviour
    # where the backbone's official default reproduces a reference defect (docs/parity.md).
    corrected: ClassVar[dict[str, Any]] = {}
    low_precision_fields: ClassVar[tuple[str, ...]] = ()
    query_redraw: bool = False  # a backbone taking the switch sets it (batch_vectors)
    window_length: object = None  # a backbone with Gaussian windows sets its span setting (batch_dependent_videos)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        rename_legacy_keys(state_dict, prefix, self.legacy_keys)  # before the sub-modules read their keys
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict``, refusing weights whose entries for one shared tensor differ
        (:func:`check_shared_entries`)."""
        check_shared_entries(self, state_dict)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def request(self, *, training: Iterable[str] = (), retrieval: Iterable[str] = ()) -> None:
        """Ask for capabilities in training mode and in eval (retrieval) mode (an unknown name is a
        ValueError; whether this backbone ``provides`` them is checked by the model factory)."""
        wanted = {True: frozenset(training), False: frozenset(retrieval)}
        for names in wanted.values():
            check_capabilities(names, type(self).__name__)
        self.__dict__["_requested"] = wanted

    def exposes(self, capability: str) -> bool:
        """Whether ``encode_*`` should supply ``capability`` now (training forward, or the current mode)."""
        requested = self.__dict__.get("_requested")
        if requested is None:
            return False
        return capability in requested[self.training_time()]

    def keeps_word_tokens(self) -> bool:
        """Whether ``encode_queries`` keeps the per-word embeddings (``QueryEmbedding.tokens``): by default
        when the ``word_tokens`` capability is requested for the current mode; a backbone whose own
        scoring reads them says so here."""
        return self.exposes(WORD_TOKENS)

    def training_time(self) -> bool:
        """Whether ``encode_*`` runs for training: the training forward, or training mode."""
        return bool(self.__dict__.get("_forced_mode", self.training))

    @contextlib.contextmanager
    def training_exposure(self) -> Iterator[None]:
        """Supply the training-time capabilities whatever the module mode (the training forward)."""
        previous = self.__dict__.get("_forced_mode")
        self.__dict__["_forced_mode"] = True
        try:
            yield
        finally:
            if previous is None:
                self.__dict__.pop("_forced_mode", None)
            else:
                self.__dict__["_forced_mode"] = previous

    def encode_videos(self, clips: Tensor, frames: Tensor, frame_mask: Tensor) -> VideoEmbedding:
        """Encode (B, Lc, Dv) clips and (B, Lf, Dv) frames with a (B, Lf) mask."""
        raise NotImplementedError

    def encode_queries(self, queries: Tensor, query_mask: Tensor) -> QueryEmbedding:
        """Encode (Nq, Lq, Dq) token features with a (Nq, Lq) mask."""
        raise NotImplementedError

    def score(
        self, query: QueryEmbedding, video: VideoEmbedding, *, with_logits: bool = False
    ) -> dict[str, BranchScores]:
        """Per-branch (Nq, Nv) scores of every query against every video."""
        raise NotImplementedError

    def score_elements(self, video: VideoEmbedding) -> int:
        """Float32 values that scoring one query against ``video`` holds at once, at most (evaluation sizes
        its query chunks from it).  Default: one per video token of every embedding tensor, as a
        per-token score matrix would."""
        return video_tokens(video)

    def encode_budget_share(self) -> float:
        """The part (0, 1] of evaluation's CPU budget for one video batch's input features
        (:func:`~prvrlab.evaluation.retrieval.video_batch_size`) this backbone's batches may take: the
        budget was sized on GMMFormer, whose encoders hold ~2x a batch's input at once; a backbone that
        holds more per input byte returns less.  1 by default."""
        return 1.0

    def batch_dependent_videos(self) -> bool:
        """Whether a video's encoding depends on the other videos of its batch (the reference GMMFormer's
        frame windows span the batch's longest video): training then pads every DDP rank's frames to the
        global batch's longest video, and evaluation encodes a split in split order, exactly
        ``eval.video_batch_size`` videos a batch (the reference's evaluation batches).  By default: under
        ``window_length: batch`` (GMMFormer, MamFusion), where the frame windows span the batch's longest video."""
        return self.window_length == "batch"

    def index_videos(self, video: VideoEmbedding) -> VideoEmbedding:
        """The gallery as retrieval scores it: ``video`` plus per-video values that every query reuses,
        computed once per gallery (in inference) instead of once per query chunk; scores of the indexed
        gallery equal those of ``video``, and an indexed gallery is returned as it is.  ``video`` itself
        by default."""
        return video

    def fresh_word_encoder(self, *, share_positions: bool = False) -> nn.Module:
        """A newly initialised encoder of the architecture that gives this backbone's word tokens, without
        its pooling head: ``encode(queries (Nq, Lq, Dq), query_mask) -> ((N, D) packed tokens, packing)``.
        For a component with a text encoder of its own (RAL's official frame-branch query encoder).
        ``share_positions``: the copy uses this backbone's positional embedding module itself (one set of
        parameters, trained by both encoders) instead of a fresh one.
        Default: a copy of ``self.query`` (the built-in backbones' query encoder) re-drawn from N(0, 0.02)."""
        import copy

        query = getattr(self, "query", None)
        if not isinstance(query, nn.Module) or not hasattr(query, "encode"):
            raise ValueError(f"{type(self).__name__} has no query encoder to copy (an nn.Module 'query' with encode())")
        fresh = copy.deepcopy(query)
        fresh.pool = None
        init_normal_(fresh)
        if share_positions:
            if not isinstance(getattr(query, "pos", None), nn.Module):
                raise ValueError(f"{type(self).__name__}'s query encoder has no positional embedding module 'pos' to share")
            fresh.pos = query.pos
        return fresh

    def batch_vectors(
        self, batch: Batch, query: QueryEmbedding, video: VideoEmbedding, redrawn: QueryEmbedding | None = None
    ) -> dict[str, Tensor]:
        """Training-only (Nq, D) query vectors computed from the whole batch (e.g. queries fused with
        the batch's videos), added to ``query.vectors`` before scoring.  By default only ``redrawn``, where
        the backbone's ``query_redraw`` is on: the first branch's vector of ``redrawn`` (:meth:`redrawn_queries`,
        encoded by :meth:`encode_batch`)."""
        if redrawn is None:
            return {}
        return {"redrawn": redrawn.vectors[next(iter(self.score_weights))]}  # (Nq, D)

    def redrawn_queries(self, batch: Batch) -> QueryEmbedding:
        """The batch's queries encoded a second time (in training: another dropout draw), as the reference
        GMMFormer, GMMFormer v2 and MamFusion ``forward`` encode them again for their query-level losses
        (``query_redraw``)."""
        return self.encode_queries(batch.queries, batch.query_mask)

    def batch_vector_names(self) -> tuple[str, ...]:
        """The names of the vectors :meth:`batch_vectors` adds that are no scoring branch (a loss's ``branch``
        may name them as well as the branches): ``redrawn`` where ``query_redraw`` is on."""
        return ("redrawn",) if self.query_redraw else ()

    def fuse(self, scores: dict[str, BranchScores]) -> Tensor:
        """Final (Nq, Nv) retrieval score: weighted sum of branch similarities."""
        total = None
        for name, weight in self.score_weights.items():
            if weight == 0.0:
                continue
            if scores[name].targets is not None:
                raise ValueError(
                    f"branch {name!r} holds training scores whose columns are not the videos (targets set); "
                    "fuse retrieval scores (model.score outside the training forward)"
                )
            part = weight * scores[name].sim
            total = part if total is None else total + part
        if total is None:
            raise ValueError("all score_weights are zero")
        return total

    def encode_batch(self, batch: Batch) -> BatchEncoding:
        """The training path's first half: each video and query encoded on its own, with the training-time
        capabilities (and the queries again under ``query_redraw``)."""
        with self.training_exposure():
            video = self.encode_videos(batch.clips, batch.frames, batch.frame_mask)
            query = self.encode_queries(batch.queries, batch.query_mask)
            redrawn = self.redrawn_queries(batch) if self.query_redraw else None
        return BatchEncoding(query=query, video=video, redrawn=redrawn)

    def score_batch(self, batch: Batch, encoding: BatchEncoding) -> ModelOutput:
        """The training path's second half, over every row of ``batch`` (one rank's share, or the global
        batch gathered from the DDP ranks): the batch vectors, then every query scored against every
        video with logits."""
        query, video = encoding.query, encoding.video
        with self.training_exposure():
            query.vectors.update(self.batch_vectors(batch, query, video, encoding.redrawn))
        query.own_video = batch.query_video
        scores = self.score(query, video, with_logits=True)
        return ModelOutput(scores=scores, query=query, video=video, batch=batch)

    def forward(self, batch: Batch) -> ModelOutput:
        """The training path: :meth:`encode_batch`, then :meth:`score_batch`."""
        return self.score_batch(batch, self.encode_batch(batch))
