"""ARL (Ambiguity-Restrained representation Learning, Cho et al., AAAI 2025): label-ambiguity detection.

Works on any backbone with per-frame embeddings (capability ``frame_tokens``)
and a query vector for ``branch`` (default ``frame``): q_i = the query's
branch vector, v_jk = the video's frame tokens, both in the backbone's
hidden space; s^f = cos(q_i, v_jk) (Eq. 2), s = max over real frames with
k_hat its argmax (Eq. 3).  On the ``arl`` backbone this *is* its retrieval
score; on GMMFormer / GMMFormer v2 / MS-SL the plug-in trains those frame
tokens with the ``arl`` loss and changes no retrieval score (except Eq. 13).

Dataset-wide uncertainty (Eq. 4), recomputed with the current model at the
start of every epoch from ``warmup_epochs`` on (:meth:`ARL.on_epoch_start`).
With q^ and v^ the L2-normalised vectors, M_xyz = q^_x . v^_yz, so::

    U^q_x  = q^_x . mean_{all real frames} v^          U^v_yz = v^_yz . mean_{all queries} q^

exact, O((N_q + sum_v L_v) d): one pass over the training split encodes
it, the two mean vectors are summed over DDP ranks with ``ctx.all_reduce``
(float64), every rank scatters its uncertainties into dataset-wide tables
(queries (N_q,), frames (N_v, L_max)) that are summed over the ranks too,
so every rank ends with the same values.  Videos the sampler repeats to
even out the ranks' shares are counted once (the first occurrence, in rank
order, owns them).  The mean of a video's uncertainty is over its *real*
frames (the paper writes N_v L_v for equal lengths).

Pair uncertainty (Eq. 5): u^f(q_i, v_jk) = (U^q_i + U^v_jk) / 2 and
u(q_i, V_j) = u^f(q_i, v_j,k_hat).  Label-ambiguity detection (Eqs. 6-7) on
every batch with the uncertainty of the epoch start and the current
(detached) similarities: text-video pairs with s > tau_s and u > tau_u,
text-frame pairs with s^f > tau_s and u^f > tau_u (the same mask read by rows
gives A^q_i, by columns A^v_j).  Positive pairs are removed by the loss.

Thresholds (``tau_s_mode`` / ``tau_u_mode``): ``fixed`` uses ``tau_s`` /
``tau_u``; ``rule`` (the paper's implementation details) sets, every epoch,
tau_s = the mean of s over the training set's positive pairs and tau_u = the
mean of "the uncertainty distribution of the train dataset".  The only
uncertainty distribution the paper shows is Fig. 4b, of the pair uncertainty
u(q_i, V_j) (Eq. 5, read at k_hat: "the text-video averaged uncertainty ...
as pairwise uncertainty is utilized to detect ambiguous pairs"), so tau_u is
the mean of u over the training set's text-video pairs (one positive and
N_v - 1 unpaired per query; the unpaired mean is estimated on the in-batch
pairs of the epoch-start pass, a choice: the exact mean needs the
N_q x N_v x L_v map; under DDP the pairs of each step's global batch, every
rank's queries against each rank's videos, so tau_u does not depend on the
number of workers).  The same tau_u serves the text-frame level (one tau_u
in the paper).  Not m_q . m_f, the mean of U^q, of U^v and of u^f over
text-frame pairs: k_hat picks each pair's most similar frame, whose U^v is
above the frame average, so u > m_q . m_f lets through nearly every pair
with s > tau_s (88-97% on the synthetic collection; docs/arl.md).

Detection quality on the synthetic collection (docs/arl.md, measured with
benchmarks/arl_detection.py against the generator's ground truth): the
detected pairs are only a little more often truly relevant than a random
unpaired pair (precision 4.0-5.3% against a 3.4% base rate on ``tiny``),
because s separates truly relevant unpaired pairs only weakly (ROC AUC
0.555-0.608, rising as training goes on) and u hardly (AUC 0.52-0.54): an
instance's dataset-wide uncertainty says how generic it is, not whether a
given pair shares its concept.  This follows the paper; a stricter tau_s
(``tau_s_mode: fixed``) raises precision at the cost of recall.

Switches: ``text_video`` (T-V ambiguity in L_video), ``text_frame`` (the
text-frame objective L_frame with T-F ambiguity), ``cross_model`` (two
identical encoders, each trained with the sets the *other* detects; the
retrieval score of every branch is their average, Eq. 13; other loss terms
of the config, e.g. a host backbone's clip-branch triplet, then train on
that average, so both encoders).  With
``text_video`` and ``text_frame`` off nothing is detected and the ``arl``
loss is the base NCE + triplet (Table 5 (a)); before ``warmup_epochs`` the
loss is the base one too (warm-up, the paper's "few epochs"; the number is
not given, ours is a config value).

Distributions (the paper's Fig. 4, run artifacts
``distributions/arl.similarity.json`` and ``distributions/arl.uncertainty.json``,
:meth:`Component.log_distribution`): s and u of the first encoder's positive
and unpaired in-batch pairs at the start of every detecting epoch (the last
one is kept), 200 bins of [-1, 1].

Metrics: ``tau_s``, ``tau_u`` (epoch start; ``tau_s_1`` / ``tau_u_1`` for the
second encoder), ``ambiguous_tv`` / ``ambiguous_tf`` (pairs detected per batch
by the first encoder, positives excluded; text-frame: frames of the query's
own video other than its k_hat), and, when the training split has a ground
truth (synthetic data), ``precision_tv`` / ``recall_tv`` of the detected
text-video pairs against the truly relevant unpaired pairs of the epoch's
batches (detection only ever sees a batch; omitted before warm-up ends).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from prvrlab.checks import check_bool, check_choice, check_identifier, check_int, check_number
from prvrlab.data.batch import Batch, host_to_device
from prvrlab.losses._common import positive_mask
from prvrlab.models.base import BranchScores, QueryEmbedding, RetrievalModel, VideoEmbedding
from prvrlab.models.component import FRAME_TOKENS, EpochContext, StepContext
from prvrlab.models.global_batch import gather_rows
from prvrlab.models.plugins.base import Plugin, PluginError
from prvrlab.registry import PLUGINS

_EPS = 1e-6
DISTRIBUTION_BINS = 200  # of [-1, 1] for the logged similarity / uncertainty distributions


# ---------------------------------------------------------------- similarity and detection


def frame_similarity(query: Tensor, frames: Tensor) -> Tensor:
    """s^f: (Nq, D) queries, (Nv, Lf, D) frames -> (Nq, Nv, Lf) cosines (fp32, padding not masked)."""
    with torch.autocast(device_type=query.device.type, enabled=False):
        q = F.normalize(query.float(), dim=-1, eps=_EPS)  # (Nq, D)
        v = F.normalize(frames.float(), dim=-1, eps=_EPS)  # (Nv, Lf, D)
        return torch.einsum("qd,vld->qvl", q, v)  # (Nq, Nv, Lf)


def best_frame(frame_sim: Tensor, frame_mask: Tensor) -> tuple[Tensor, Tensor]:
    """s (Nq, Nv) = max over real frames of s^f and k_hat (Nq, Nv) its index (Eq. 3); a video
    without real frames scores -1 at k_hat 0."""
    masked = frame_sim.masked_fill(~frame_mask.to(torch.bool)[None], float("-inf"))  # (Nq, Nv, Lf)
    s, k_hat = masked.max(dim=-1)  # (Nq, Nv)
    return torch.where(torch.isfinite(s), s, torch.full_like(s, -1.0)), k_hat


def detect_ambiguity(
    frame_sim: Tensor,
    frame_mask: Tensor,
    query_unc: Tensor,
    frame_unc: Tensor,
    tau_s: float,
    tau_u: float,
) -> tuple[Tensor, Tensor]:
    """Eqs. 5-7: (text-video (Nq, Nv), text-frame (Nq, Nv, Lf)) ambiguity masks (positives not removed).

    ``frame_sim`` s^f (Nq, Nv, Lf), ``frame_mask`` (Nv, Lf), ``query_unc`` U^q
    (Nq,), ``frame_unc`` U^v (Nv, Lf).
    """
    mask = frame_mask.to(torch.bool)
    s, k_hat = best_frame(frame_sim, mask)  # (Nq, Nv)
    u_f = 0.5 * (query_unc[:, None, None] + frame_unc[None])  # (Nq, Nv, Lf)
    u = u_f.gather(2, k_hat[..., None]).squeeze(-1)  # (Nq, Nv)
    video = (s > tau_s) & (u > tau_u) & mask.any(dim=1)[None]  # (Nq, Nv)
    frame = (frame_sim > tau_s) & (u_f > tau_u) & mask[None]  # (Nq, Nv, Lf)
    return video, frame


def naive_uncertainty(queries: Tensor, frames: Tensor, frame_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Eq. 4 literally, through the (Nq, Nv, Lf) map M (tests only): U^q (Nq,), U^v (Nv, Lf)."""
    m = frame_similarity(queries, frames).double()  # (Nq, Nv, Lf)
    mask = frame_mask.to(torch.bool)
    query_unc = (m * mask[None]).sum(dim=(1, 2)) / mask.sum()  # (Nq,)
    frame_unc = m.mean(dim=0) * mask  # (Nv, Lf)
    return query_unc, frame_unc


# ---------------------------------------------------------------- dataset-wide uncertainty


@dataclass
class UncertaintyTables:
    """One encoder's dataset-wide uncertainties (Eq. 4) and thresholds of an epoch."""

    query_rows: dict[str, int]  # query id -> row of ``query``
    query: Tensor  # (N_q,) U^q
    video_rows: dict[str, int]  # video id -> row of ``frame``
    frame: Tensor  # (N_v, L_max) U^v, 0 on padding
    tau_s: float
    tau_u: float

    def lookup(self, query_ids: Sequence[str], video_ids: Sequence[str], length: int) -> tuple[Tensor, Tensor]:
        """U^q (Nq,) and U^v (Nv, length) of a batch."""
        try:
            q_rows = [self.query_rows[i] for i in query_ids]
            v_rows = [self.video_rows[i] for i in video_ids]
        except KeyError as exc:
            raise PluginError(f"arl: {exc.args[0]!r} is not in the training split encoded at epoch start") from None
        rows = host_to_device(np.asarray(q_rows + v_rows, dtype=np.int64), self.frame.device)  # no host wait
        frame = self.frame[rows[len(q_rows):]]  # (Nv, L_max)
        if frame.shape[1] < length:
            frame = F.pad(frame, (0, length - frame.shape[1]))
        return self.query[rows[: len(q_rows)]], frame[:, :length]


@dataclass
class _Encoded:
    """One rank's normalised vectors of the epoch-start pass for one encoder, per batch."""

    queries: list[Tensor]  # (Nq, D) q^
    frames: list[Tensor]  # (Nf, D) v^ of the real frames only
    positive: list[Tensor]  # (Nq,) s of each query with its own video


def _owned(local: Sequence[str], per_rank: Sequence[Sequence[str]], rank: int) -> tuple[list[bool], list[str]]:
    """Which of this rank's items (in order) own their id (first occurrence in rank order), and the
    dataset-wide order of the distinct ids."""
    seen: set[str] = set()
    order: list[str] = []
    keep: list[bool] = []
    for r, ids in enumerate(per_rank):
        for item in ids:
            first = item not in seen
            if first:
                seen.add(item)
                order.append(item)
            if r == rank:
                keep.append(first)
    return keep, order


def _gather_ids(ctx: EpochContext, ids: tuple[list[str], list[str]]) -> list[tuple[list[str], list[str]]]:
    """Every rank's (query ids, video ids), in rank order."""
    if ctx.world_size == 1 or ctx.process_group is None:
        return [ids]
    import torch.distributed as dist

    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, ids, group=ctx.process_group)
    return out


def _step_count(ctx: EpochContext, local: int) -> int:
    """The most batches any rank has in the epoch-start pass (the sampler gives every rank as many)."""
    if ctx.world_size == 1 or ctx.process_group is None:
        return local
    return int(ctx.all_reduce(torch.tensor([float(local)], device=ctx.device), "max").item())


def _gather_step(ctx: EpochContext, rows: Tensor, videos: int) -> tuple[Tensor, int]:
    """Every rank's ``rows`` (n_r, C) of one step in rank order, their video column (the last) made global
    (shifted by the videos of the ranks before), and the first global video of this rank's ``videos``."""
    if ctx.world_size == 1 or ctx.process_group is None:
        return rows, 0
    import torch.distributed as dist

    sizes = [torch.zeros(2, dtype=torch.long, device=rows.device) for _ in range(ctx.world_size)]
    dist.all_gather(sizes, torch.tensor([rows.shape[0], videos], dtype=torch.long, device=rows.device),
                    group=ctx.process_group)
    counts, shifts = torch.stack(sizes).cpu().T.tolist()  # rows and videos of each rank
    first = np.cumsum([0, *shifts[:-1]])  # (world,) each rank's first video in the step
    padded = F.pad(rows, (0, 0, 0, max(counts) - rows.shape[0]))
    out = gather_rows(padded, counts, group=ctx.process_group)  # (sum(counts), C)
    out[:, -1] += torch.repeat_interleave(torch.as_tensor(first, dtype=out.dtype, device=out.device),
                                          torch.as_tensor(counts, device=out.device))
    return out, int(first[ctx.rank])


def _ownership(ctx: EpochContext, query_ids: list[str], video_ids: list[str]) -> tuple[Tensor, list[str], Tensor, list[str]]:
    """(owned (nq_local,), dataset-wide query order, owned (nv_local,), video order) of this rank's items."""
    per_rank = _gather_ids(ctx, (query_ids, video_ids))
    keep_q, q_order = _owned(query_ids, [p[0] for p in per_rank], ctx.rank)
    keep_v, v_order = _owned(video_ids, [p[1] for p in per_rank], ctx.rank)
    as_mask = lambda keep: torch.tensor(keep, dtype=torch.bool, device=ctx.device)  # noqa: E731
    return as_mask(keep_q), q_order, as_mask(keep_v), v_order


def reduce_uncertainty(
    ctx: EpochContext,
    encoded: Sequence[_Encoded],
    query_ids: list[str],
    video_ids: list[str],
    frame_slots: list[tuple[Tensor, Tensor]],
    fixed: tuple[float | None, float | None],
) -> list[UncertaintyTables]:
    """Eq. 4 for every encoder from this rank's share, summed over the ranks (module docstring).

    ``frame_slots``: per batch, (local video index, position) (Nf,) of every
    real frame of ``encoded[*].frames``; ``fixed``: (tau_s, tau_u), None where
    the rule sets the threshold (tau_u by the rule is left NaN here: it needs
    the pair uncertainties, :func:`pair_values`).  Sums in float32 per batch,
    float64 across batches and ranks; O((N_q + sum L_v) d): two GEMVs over
    each batch's frames and one scatter (``index_add_``), no padding, no copy.
    """
    keep_q, q_order, keep_v, v_order = _ownership(ctx, query_ids, video_ids)
    device = ctx.device
    q_rows = {item: row for row, item in enumerate(q_order)}
    v_rows = {item: row for row, item in enumerate(v_order)}
    global_q = torch.tensor([q_rows[i] for i in query_ids], dtype=torch.long, device=device)  # (nq_local,)
    global_v = torch.tensor([v_rows[i] for i in video_ids], dtype=torch.long, device=device)  # (nv_local,)
    length = max([int(k.max()) + 1 for _, k in frame_slots if k.numel()] or [1])
    length = int(ctx.all_reduce(torch.tensor([length], device=device), op="max").item())
    # Per batch, shared by the encoders: where each query / real frame goes in the tables (frames: in the
    # flattened (N_v * L,) table) and its weight, 1 where this rank owns it, else 0 (repeats count once);
    # the tables are filled by index_add of weighted values, so a repeat adds 0 and no boolean copy is made.
    q_parts = torch.tensor([len(p) for p in encoded[0].queries]).cumsum(0).tolist()
    q_slices = [slice(a, b) for a, b in zip([0] + q_parts[:-1], q_parts)]
    q_weight = [keep_q[part].float() for part in q_slices]  # per batch (Nq,)
    f_index = [global_v[video] * length + position for video, position in frame_slots]  # per batch (Nf,)
    f_weight = [keep_v[video].float() for video, _ in frame_slots]  # per batch (Nf,)

    tables = []
    for enc in encoded:
        dim = enc.queries[0].shape[1]
        # 1. the queries (small): sum of q^, count, sum of positive-pair s -> m_q, tau_s
        q_sums = torch.zeros(dim + 2, dtype=torch.float64, device=device)
        for weight, q, positive in zip(q_weight, enc.queries, enc.positive):  # float32 per batch, float64 across
            q_sums[:dim] += (weight @ q).double()
            q_sums[dim] += weight.sum().double()
            q_sums[dim + 1] += (weight @ positive).double()
        q_sums = ctx.all_reduce(q_sums)
        mean_q = q_sums[:dim] / q_sums[dim].clamp(min=1)  # (D,)
        # 2. one pass over the frames (each batch's read twice while in cache): U^v = v^ . m_q, sum of v^
        frame_table = torch.zeros(len(v_order) * length, dtype=torch.float32, device=device)  # (N_v * L,)
        f_sums = torch.zeros(dim + 1, dtype=torch.float64, device=device)
        mean_q32 = mean_q.float()
        for weight, index, f in zip(f_weight, f_index, enc.frames):
            frame_table.index_add_(0, index, (f @ mean_q32) * weight)  # (Nf,)
            f_sums[:dim] += (weight @ f).double()
            f_sums[dim] += weight.sum().double()
        f_sums = ctx.all_reduce(f_sums)
        mean_f = f_sums[:dim] / f_sums[dim].clamp(min=1)  # (D,)
        # 3. U^q = q^ . m_f
        query_table = torch.zeros(len(q_order), dtype=torch.float32, device=device)  # (N_q,)
        mean_f32 = mean_f.float()
        for part, weight, q in zip(q_slices, q_weight, enc.queries):
            query_table.index_add_(0, global_q[part], (q @ mean_f32) * weight)  # (Nq,)
        # every entry was written by one rank, zeros elsewhere: the float32 sum over ranks is exact
        query_table, frame_table = ctx.all_reduce(query_table), ctx.all_reduce(frame_table)
        tau_s = float(q_sums[dim + 1] / q_sums[dim].clamp(min=1)) if fixed[0] is None else fixed[0]
        tau_u = float("nan") if fixed[1] is None else fixed[1]  # the rule's: ARL._rule_tau_u
        tables.append(UncertaintyTables(q_rows, query_table, v_rows, frame_table.view(len(v_order), length), tau_s, tau_u))
    return tables


def pair_values(
    query: Tensor,
    frames: Tensor,
    slots: tuple[Tensor, Tensor],
    num_videos: int,
    query_unc: Tensor,
    frame_unc: Tensor,
) -> tuple[Tensor, Tensor]:
    """s (Eq. 3) and u = (U^q_i + U^v_{j,k_hat}) / 2 (Eq. 5) of every text-video pair of a batch, (Nq, Nv) each.

    ``query`` q^ (Nq, D); ``frames`` the real frames' v^ (Nf, D) at ``slots``
    (video in the batch (Nf,), position (Nf,)); ``query_unc`` U^q (Nq,),
    ``frame_unc`` U^v (Nv, L) with L > every position.
    """
    video, position = slots
    mask = torch.zeros(num_videos, frame_unc.shape[1], dtype=torch.bool, device=query.device)  # (Nv, L)
    mask[video, position] = True
    sim = query.new_zeros(query.shape[0], *mask.shape)  # (Nq, Nv, L)
    sim[:, video, position] = query @ frames.T  # (Nq, Nf)
    s, k_hat = best_frame(sim, mask)  # (Nq, Nv)
    u = 0.5 * (query_unc[:, None] + frame_unc[torch.arange(num_videos, device=query.device)[None], k_hat])  # (Nq, Nv)
    return s, u


# ---------------------------------------------------------------- the plug-in


@PLUGINS.register("arl")
class ARL(Plugin):
    """ARL's ambiguity detection and cross-model encoders (see the module docstring)."""

    switch_params = ("text_video", "text_frame", "cross_model")
    # training_aux reads the encodings and the batch's ids; under a global batch every rank adds the same
    # ground-truth counts in on_step_end, which scales them alike: the precision and recall ratios hold
    supports_global_batch = True
    applies_when = {"tau_s": {"tau_s_mode": ("fixed",)}, "tau_u": {"tau_u_mode": ("fixed",)}}

    def __init__(
        self,
        *,
        hidden_size: int,
        text_video: bool = True,
        text_frame: bool = True,
        cross_model: bool = True,
        warmup_epochs: int = 5,
        tau_s_mode: Literal["rule", "fixed"] = "rule",
        tau_s: float = 0.5,
        tau_u_mode: Literal["rule", "fixed"] = "rule",
        tau_u: float = 0.0,
        branch: str = "frame",
    ) -> None:
        super().__init__()
        self.text_video = check_bool(text_video, "text_video")
        self.text_frame = check_bool(text_frame, "text_frame")
        self.cross_model = check_bool(cross_model, "cross_model")
        self.warmup_epochs = check_int(warmup_epochs, "warmup_epochs", minimum=0)
        self.tau_s_mode = check_choice(tau_s_mode, "tau_s_mode", ("rule", "fixed"))
        self.tau_u_mode = check_choice(tau_u_mode, "tau_u_mode", ("rule", "fixed"))
        for name, value in (("tau_s", tau_s), ("tau_u", tau_u)):
            if not (check_number(value, name) >= -1.0 and value <= 1.0):
                raise ValueError(f"{name} must be a cosine in [-1, 1], got {value!r}")
        self.tau_s, self.tau_u = float(tau_s), float(tau_u)
        self.branch = check_identifier(branch, "branch", "'frame'")
        self.__dict__["_tables"] = []  # per encoder, set at epoch start (not state: recomputed every epoch)
        self.__dict__["_truth_counts"] = None

    # ------------------------------------------------------------ contract

    def check_backbone(self, backbone: RetrievalModel, backbone_name: str) -> None:
        branches = list(getattr(backbone, "score_weights", {}))
        if self.branch not in branches:
            raise PluginError(
                f"ARL scores a query vector against per-frame embeddings; backbone '{backbone_name}' has no "
                f"'{self.branch}' branch (branches: {', '.join(branches)}); set plugins.arl.branch"
            )

    def attach(self, backbone: RetrievalModel, *, make_backbone: Callable[[], RetrievalModel] | None) -> None:
        super().attach(backbone, make_backbone=make_backbone)
        if self.cross_model:
            if make_backbone is None:
                raise PluginError("arl: cross_model needs the model factory's make_backbone")
            self.peer = make_backbone()  # model Phi: optimised, DDP-averaged, checkpointed with the model
            self.peer.request(training={FRAME_TOKENS})

    def needs(self, *, training: bool) -> frozenset[str]:
        return frozenset({FRAME_TOKENS}) if training else frozenset()

    def metric_names(self) -> tuple[str, ...]:
        names = ("tau_s", "tau_u", "ambiguous_tv", "ambiguous_tf", "precision_tv", "recall_tv")
        return names + (("tau_s_1", "tau_u_1") if self.cross_model else ())

    def aux_keys(self) -> tuple[str, ...]:
        keys = ("frame_mask", "frame_on", "frame_sim0", "best_frame0", "video_sets0", "frame_sets0")
        return keys + (("frame_sim1", "best_frame1", "video_sets1", "frame_sets1") if self.cross_model else ())

    def detecting(self, epoch: int) -> bool:
        """Whether ambiguity is detected in ``epoch`` (after warm-up, with a level switched on)."""
        return (self.text_video or self.text_frame) and epoch >= self.warmup_epochs

    # ------------------------------------------------------------ encoders

    def encode_videos(self, clips: Tensor, frames: Tensor, frame_mask: Tensor, video: VideoEmbedding) -> dict[str, Any]:
        if not self.cross_model:
            return {}
        exposure = self.peer.training_exposure() if self.host.exposes(FRAME_TOKENS) else contextlib.nullcontext()
        with exposure:
            return {"video": self.peer.encode_videos(clips, frames, frame_mask)}

    def encode_queries(self, queries: Tensor, query_mask: Tensor, query: QueryEmbedding) -> dict[str, Any]:
        if not self.cross_model:
            return {}
        return {"query": self.peer.encode_queries(queries, query_mask)}

    def index_videos(self, video: VideoEmbedding) -> dict[str, Any]:
        """With ``cross_model``: the second encoder's gallery, indexed by that encoder."""
        if not self.cross_model or "arl.video" not in video.extra:
            return {}
        return {"video": self.peer.index_videos(video.extra["arl.video"])}

    def adjust_scores(
        self, query: QueryEmbedding, video: VideoEmbedding, scores: dict[str, BranchScores], *, with_logits: bool
    ) -> dict[str, BranchScores]:
        """Eq. 13 with ``cross_model``: every branch's score is the mean of the two encoders'."""
        if not self.cross_model:
            return scores
        peer_query = replace(query.extra["arl.query"], own_video=query.own_video)  # the same training pairs
        other = self.peer.score(peer_query, video.extra["arl.video"], with_logits=with_logits)
        out = dict(scores)
        for name, own in scores.items():
            peer = other[name]
            logits = None if own.logits is None or peer.logits is None else 0.5 * (own.logits + peer.logits)
            out[name] = BranchScores(sim=0.5 * (own.sim + peer.sim), logits=logits, targets=own.targets)
        return out

    def encoder_views(self, query: QueryEmbedding, video: VideoEmbedding) -> list[tuple[Tensor, Tensor, Tensor]]:
        """(q (Nq, D), frames (Nv, Lf, D), mask (Nv, Lf)) of every encoder (theta, then Phi)."""
        views = [(query, video)]
        if self.cross_model:
            views.append((query.extra["arl.query"], video.extra["arl.video"]))
        out = []
        for q, v in views:
            if self.branch not in q.vectors:
                raise PluginError(f"arl: the query embedding has no '{self.branch}' vector ({', '.join(q.vectors)})")
            frames, mask = v.frame_tokens()  # (Nv, Lf, D), (Nv, Lf)
            out.append((q.vectors[self.branch], frames, mask))
        return out

    # ------------------------------------------------------------ epoch start: Eq. 4

    def on_epoch_start(self, ctx: EpochContext) -> dict[str, float]:
        self.__dict__["_tables"] = []
        self.__dict__["_truth_counts"] = None
        if not self.detecting(ctx.epoch):
            return {}
        tables = self.dataset_uncertainty(ctx)
        self.__dict__["_tables"] = tables
        self.__dict__["_truth_counts"] = torch.zeros(3, dtype=torch.float64, device=ctx.device)  # TP, FP, FN
        out = {"tau_s": tables[0].tau_s, "tau_u": tables[0].tau_u}
        if len(tables) > 1:
            out.update(tau_s_1=tables[1].tau_s, tau_u_1=tables[1].tau_u)
        return out

    def dataset_uncertainty(self, ctx: EpochContext) -> list[UncertaintyTables]:
        """Encode this rank's share of the training split with the current model and reduce Eq. 4; then,
        from the kept vectors, s and u of every in-batch pair: tau_u by the rule and the Fig. 4 distributions.

        Keeps q^ and the real frames' v^ of the share (4 (N_q + sum L_v) d bytes per encoder); the pair
        pass costs one similarity map per batch, as a training step's forward.
        """
        encoded: list[_Encoded] = []
        query_ids: list[str] = []
        video_ids: list[str] = []
        frame_slots: list[tuple[Tensor, Tensor]] = []
        layouts: list[tuple[int, int, int, Tensor]] = []  # per batch: first query, first video, videos, query_video
        for batch in ctx.train_batches():
            video, query = ctx.encode(batch)
            views = self.encoder_views(query, video)
            encoded = encoded or [_Encoded([], [], []) for _ in views]
            query_video = batch.query_video.to(ctx.device)
            layouts.append((len(query_ids), len(video_ids), len(batch.video_ids), query_video))
            mask = views[0][2].to(torch.bool)  # (Nv, Lf)
            slots = mask.nonzero(as_tuple=True)  # (Nf,), (Nf,)
            frame_slots.append((slots[0] + len(video_ids), slots[1]))
            for enc, (q, frames, _) in zip(encoded, views):
                qn = F.normalize(q.float(), dim=-1, eps=_EPS)  # (Nq, D)
                fn = F.normalize(frames.float(), dim=-1, eps=_EPS)  # (Nv, Lf, D)
                own = torch.einsum("qd,qld->ql", qn, fn[query_video])  # (Nq, Lf): s^f with the own video
                own = own.masked_fill(~mask[query_video], float("-inf")).amax(dim=1)  # (Nq,)
                enc.queries.append(qn)
                enc.frames.append(fn[mask])  # (Nf, D)
                enc.positive.append(torch.where(torch.isfinite(own), own, torch.full_like(own, -1.0)))
            query_ids.extend(batch.query_ids)
            video_ids.extend(batch.video_ids)
        if not encoded:
            raise PluginError("arl: the training split yielded no batch at epoch start")
        fixed = (self.tau_s if self.tau_s_mode == "fixed" else None, self.tau_u if self.tau_u_mode == "fixed" else None)
        tables = reduce_uncertainty(ctx, encoded, query_ids, video_ids, frame_slots, fixed)
        keep_q, _, keep_v, _ = _ownership(ctx, query_ids, video_ids)
        steps = _step_count(ctx, len(layouts))
        for m, (enc, table) in enumerate(zip(encoded, tables)):
            values: dict[str, list[Tensor]] = {"s+": [], "s-": [], "u+": [], "u-": []}  # s / u of positive / unpaired
            for b in range(steps):
                # the step's global batch: every rank's queries against this rank's videos, so that the in-batch
                # pairs are those of the batch one worker would hold, whatever the number of workers
                if b < len(layouts):
                    q, f, (video, position), (q0, v0, nv, query_video) = enc.queries[b], enc.frames[b], frame_slots[b], layouts[b]
                else:  # a rank with fewer batches joins the gather with none
                    q, f = enc.queries[0][:0], enc.frames[0][:0]
                    video = position = query_video = torch.zeros(0, dtype=torch.long, device=ctx.device)
                    q0 = v0 = nv = 0
                nq = q.shape[0]
                length = int(position.max()) + 1 if position.numel() else 1
                query_unc, frame_unc = table.lookup(query_ids[q0 : q0 + nq], video_ids[v0 : v0 + nv], length)
                rows = torch.cat([q, query_unc.to(q.dtype)[:, None], keep_q[q0 : q0 + nq, None].to(q.dtype),
                                  query_video[:, None].to(q.dtype)], dim=1)  # (Nq, D + 3)
                rows, offset = _gather_step(ctx, rows, nv)  # (Nq_global, D + 3), this rank's first video in the step
                if nv == 0 or rows.shape[0] == 0:
                    continue
                d = q.shape[1]
                s, u = pair_values(rows[:, :d], f, (video - v0, position), nv, rows[:, d], frame_unc.to(q.dtype))
                owned = rows[:, d + 1, None].bool() & keep_v[None, v0 : v0 + nv]  # (Nq_global, Nv): counted once
                positive = positive_mask(rows[:, d + 2].long() - offset, nv)  # (Nq_global, Nv)
                for key, sel in (("+", owned & positive), ("-", owned & ~positive)):
                    values["s" + key].append(s[sel])
                    values["u" + key].append(u[sel])
            flat = {k: torch.cat(v) if v else torch.zeros(0, device=ctx.device) for k, v in values.items()}
            if fixed[1] is None:
                table.tau_u = self._rule_tau_u(ctx, flat["u+"], flat["u-"], len(table.video_rows))
            if m == 0:  # the paper's Fig. 4 for theta
                for quantity, key in (("similarity", "s"), ("uncertainty", "u")):
                    series = {"positive": flat[key + "+"], "unpaired": flat[key + "-"]}
                    self.log_distribution(quantity, series, low=-1.0, high=1.0, bins=DISTRIBUTION_BINS)
        return tables

    @staticmethod
    def _rule_tau_u(ctx: EpochContext, positive: Tensor, unpaired: Tensor, num_videos: int) -> float:
        """Mean of u over the training set's text-video pairs: 1 positive and N_v - 1 unpaired per query,
        the unpaired mean estimated on the in-batch pairs."""
        sums = ctx.all_reduce(torch.stack([positive.double().sum(), positive.new_tensor(positive.numel(), dtype=torch.float64),
                                           unpaired.double().sum(), unpaired.new_tensor(unpaired.numel(), dtype=torch.float64)]))
        mean_pos, n_pos, mean_unp, n_unp = float(sums[0]), float(sums[1]), float(sums[2]), float(sums[3])
        mean_pos, mean_unp = mean_pos / max(n_pos, 1.0), mean_unp / max(n_unp, 1.0)
        if n_unp == 0:
            return mean_pos
        return mean_pos / num_videos + mean_unp * (1.0 - 1.0 / num_videos)

    # ------------------------------------------------------------ every step: Eqs. 5-7

    def training_aux(self, batch: Batch, query: QueryEmbedding, video: VideoEmbedding) -> dict[str, Any]:
        views = self.encoder_views(query, video)
        tables: list[UncertaintyTables] = self.__dict__["_tables"]
        mask = views[0][2].to(torch.bool)  # (Nv, Lf)
        nq, (nv, length) = views[0][0].shape[0], mask.shape
        detected = []
        aux: dict[str, Any] = {"frame_mask": mask}
        for m, (q, frames, frame_mask) in enumerate(views):
            sim = frame_similarity(q, frames)  # (Nq, Nv, Lf), with gradient
            aux[f"frame_sim{m}"] = sim
            aux[f"best_frame{m}"] = best_frame(sim.detach(), frame_mask)[1]  # (Nq, Nv)
            if tables:
                query_unc, frame_unc = tables[m].lookup(batch.query_ids, batch.video_ids, length)
                video_sets, frame_sets = detect_ambiguity(
                    sim.detach(), frame_mask, query_unc, frame_unc, tables[m].tau_s, tables[m].tau_u
                )
                if not self.text_video:
                    video_sets = torch.zeros_like(video_sets)
                if not self.text_frame:
                    frame_sets = torch.zeros_like(frame_sets)
            else:
                video_sets = torch.zeros(nq, nv, dtype=torch.bool, device=sim.device)
                frame_sets = torch.zeros(nq, nv, length, dtype=torch.bool, device=sim.device)
            detected.append((video_sets, frame_sets))
        for m in range(len(views)):  # each encoder trains with the other's sets (cross-model), else its own
            video_sets, frame_sets = detected[1 - m] if self.cross_model else detected[m]
            aux[f"video_sets{m}"], aux[f"frame_sets{m}"] = video_sets, frame_sets
        aux["frame_on"] = torch.tensor(bool(tables) and self.text_frame)  # on the CPU: the loss reads it there
        self._log_counts(batch, detected[0], aux["best_frame0"])
        return aux

    def _log_counts(self, batch: Batch, detected: tuple[Tensor, Tensor], k_hat: Tensor) -> None:
        """ambiguous_tv / ambiguous_tf of the first encoder's detection in this batch."""
        video_sets, frame_sets = detected
        query_video = batch.query_video.to(video_sets.device)
        positive = positive_mask(query_video, video_sets.shape[1])  # (Nq, Nv)
        rows = torch.arange(query_video.shape[0], device=video_sets.device)
        own = frame_sets[rows, query_video]  # (Nq, Lf): frames of the query's own video
        own.scatter_(1, k_hat[rows, query_video][:, None], False)  # not the positive frame (a scatter: no host copy)
        self.log_metric("ambiguous_tv", (video_sets & ~positive).sum())
        self.log_metric("ambiguous_tf", own.sum())

    # ------------------------------------------------------------ ground truth (synthetic data)

    def on_step_end(self, ctx: StepContext) -> None:
        counts = self.__dict__.get("_truth_counts")
        truth = ctx.truth
        if counts is None or truth is None or "arl.video_sets0" not in ctx.output.aux:
            return
        detected = ctx.output.aux["arl.video_sets1" if self.cross_model else "arl.video_sets0"].detach()  # theta's sets
        batch = ctx.batch
        positive = positive_mask(batch.query_video.to(detected.device), detected.shape[1])  # (Nq, Nv)
        relevant = truth.relevant(batch.query_ids, batch.video_ids).to(detected.device) & ~positive  # (Nq, Nv)
        found = detected & ~positive
        counts += torch.stack([(found & relevant).sum(), (found & ~relevant).sum(), (~found & relevant).sum()]).double()

    def on_epoch_end(self, ctx: EpochContext) -> dict[str, float]:
        counts = self.__dict__.get("_truth_counts")
        if counts is None or ctx.truth is None:
            return {}
        tp, fp, fn = ctx.all_reduce(counts).tolist()
        out = {}
        if tp + fp > 0:
            out["precision_tv"] = tp / (tp + fp)
        if tp + fn > 0:
            out["recall_tv"] = tp / (tp + fn)
        return out
