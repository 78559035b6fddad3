"""ICE / IRM / TCP (papers/002): the training-only modules of the "cross-modal dual nature" framework.

One plug-in with three parts (``switch_params``), each feeding one loss
through ``ModelOutput.aux``; none changes a score, so retrieval is the bare
backbone's (Sec. 3.6: "the ICE, IRM and TCP modules are deactivated").
Moment-level vectors are the backbone's moment tokens
(``VideoEmbedding.moment_tokens()``, the 32 moments of ``ice_base``, the
clips of GMMFormer (v2), the sliding-window proposals of MS-SL), compared
with the query vector of ``moment_branch``.

ICE (``ice``, Sec. 3.3; loss ``ice_corr``)
    S = cos(moment, text) over all n_m = Nv * M moments and the Nq texts of
    the batch, (n_m, Nq), with every text's entries on its own video's
    moments set to -1 (padded moments -2: never selected).  A (moment i,
    text j) pair is a candidate when each is the other's arg-max
    (Eq. 4; ties go to the lower index, ``argmax``'s rule), and is kept when
    S[i, j] > ``threshold`` (strictly; 0.4 in the paper).  Selection is
    done without gradient; the aux output holds the selected moments and
    texts with gradient (``pair_moment``, ``pair_query``, (n_c, D)) and
    their indices.  The number mined per batch is logged as
    ``train/ice.mined`` (mean over the epoch's steps), the epoch's total as
    ``train/ice.mined_total``; when the training split has a ground truth
    (synthetic data, ``StepContext.truth``) the share of mined pairs whose
    text truly describes the moment's video is ``train/ice.precision``
    (pooled over the epoch; the truth is per video, so a pair counts as
    right when its moment's video shows what the text names), and the same
    share among all unpaired (text, video) pairs of the batches, what random
    mining would reach, ``train/ice.precision_chance``.  The truth is only
    read for these diagnostics.

IRM (``irm``, Sec. 3.4, Eq. 5; loss ``ice_irm``)
    For query i of video v(i): the key moment m_k = the moment of v(i) with
    the highest cosine to q (Eq. 2), v = the video-level vector of v(i),
    r_v = FC(v - m_k), r_q = FC(v - q').  q is the ``moment_branch`` query
    vector, q' the ``video_branch`` one (the same vector on ``ice_base`` and
    GMMFormer).  Choices the paper leaves open: one FC (``Linear(D, D)``)
    shared by both differences (Eq. 5 writes one FC); on backbones whose
    video-level branch keeps per-frame vectors (GMMFormer v2, MS-SL) v is
    the masked mean of the frame tokens.

TCP (``tcp``, Sec. 3.5, Eqs. 6-7; loss ``ice_tcp``)
    Each real sequence of length L gets group labels floor(r * g / L) for
    its r-th position (``groups`` g, 8 in the paper; every L / g consecutive
    positions share a label).  round(``shuffle_ratio`` * L) real positions
    (25% in the paper) are drawn at random and permuted by one random cycle,
    so every drawn position receives another drawn position's feature (a
    draw of fewer than 2 positions shuffles nothing); labels move with the
    features.  The shuffled *input* features (frames and clips, in one
    extra pass) are encoded by the backbone; a linear classifier per level
    (``Linear(D, g)``, the paper's CLS; one per level is our choice)
    predicts the group label of every real position of the original and of
    the shuffled encoded sequence.  ``tcp_levels``: ``both`` (the paper:
    video-level on the frame tokens, moment-level on the moment tokens),
    ``video`` or ``moment``.  The moment level needs one moment token per
    clip (``ice_base``, GMMFormer, GMMFormer v2; not MS-SL's proposals: use
    ``tcp_levels: video`` there).  Accuracy on the shuffled sequences is
    logged as ``train/ice.tcp_accuracy``.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from prvrlab.checks import check_bool, check_choice, check_identifier, check_int, check_number, check_positive_int
from prvrlab.data.batch import Batch, host_to_device
from prvrlab.losses._common import positive_mask
from prvrlab.models.base import QueryEmbedding, RetrievalModel, VideoEmbedding
from prvrlab.models.initialization import init_normal_
from prvrlab.models.component import FRAME_TOKENS, MOMENT_TOKENS, EpochContext, StepContext
from prvrlab.models.plugins.base import Plugin, PluginError
from prvrlab.registry import PLUGINS

_EPS = 1e-6
TCP_LEVELS = ("both", "video", "moment")
# each part's training outputs (``ice.<key>``), in the order aux_keys lists them
PART_KEYS: dict[str, tuple[str, ...]] = {
    "ice": ("pair_moment", "pair_query", "pair_video", "pair_text"),
    "irm": ("key_moment", "query", "redundant_video", "redundant_query"),
    "tcp": ("tcp_logits", "tcp_labels", "tcp_part"),
}


# ---------------------------------------------------------------- ICE


def mutual_pairs(sim: Tensor, own: Tensor, threshold: float) -> tuple[Tensor, Tensor]:
    """Mutual-nearest (moment, text) pairs of a (n_m, Nq) similarity above ``threshold``.

    ``own`` (n_m, Nq) bool marks paired entries (set to -1 before the
    search, never selected).  Returns the moment rows and text columns of
    the selected pairs, (n_c,) each, ordered by text.
    """
    s = sim.detach().float().masked_fill(own, -1.0)  # (n_m, Nq)
    if s.numel() == 0:
        empty = torch.zeros(0, dtype=torch.long, device=sim.device)
        return empty, empty
    best_text = s.argmax(dim=1)  # (n_m,)
    best_moment = s.argmax(dim=0)  # (Nq,)
    texts = torch.arange(s.shape[1], device=s.device)  # (Nq,)
    mutual = best_text[best_moment] == texts  # (Nq,)
    keep = mutual & (s[best_moment, texts] > threshold) & ~own[best_moment, texts]  # (Nq,)
    picked = keep.nonzero().squeeze(1)  # (n_c,) the texts of the pairs: their count is the one read from the device
    return best_moment.index_select(0, picked), picked


def cosine_matrix(a: Tensor, b: Tensor) -> Tensor:
    """(N, D), (M, D) -> (N, M) cosine similarities in fp32, under autocast too (bf16 products would round
    them to steps of 2^-8 near 1 and tie close moments, which the argmax then hands to the lower index)."""
    with torch.autocast(device_type=a.device.type, enabled=False):
        return F.normalize(a.float(), dim=-1, eps=_EPS) @ F.normalize(b.float(), dim=-1, eps=_EPS).t()


# ---------------------------------------------------------------- TCP


def group_labels(mask: Tensor, groups: int) -> Tensor:
    """(B, L) bool mask -> (B, L) long group label floor(r * g / L_b) of the r-th real position, -1 on padding."""
    rank = mask.long().cumsum(dim=1) - 1  # (B, L)
    length = mask.long().sum(dim=1, keepdim=True).clamp(min=1)  # (B, 1)
    labels = torch.div(rank * groups, length, rounding_mode="floor").clamp(max=groups - 1)  # (B, L)
    return torch.where(mask, labels, torch.full_like(labels, -1))


def shuffle_sources(mask: Tensor, ratio: float, generator: torch.Generator | None = None) -> Tensor:
    """(B, L) bool mask -> (B, L) long source position of the feature placed at each position.

    round(ratio * L_b) real positions of row b are drawn uniformly and
    permuted by one random cycle (each drawn position takes the next drawn
    one's feature), so exactly that many positions change (none when fewer
    than 2 are drawn); every other position is its own source.
    """
    b, length = mask.shape
    keys = torch.rand(b, length, generator=generator, device=mask.device)  # (B, L)
    keys = keys.masked_fill(~mask, 2.0)  # padding sorts last
    order = keys.argsort(dim=1)  # (B, L) real positions first, in random order
    count = torch.floor(mask.sum(dim=1).float() * ratio + 0.5).long()  # (B,)
    count = torch.where(count >= 2, count, torch.zeros_like(count))  # (B,)
    j = torch.arange(length, device=mask.device).expand(b, length)  # (B, L)
    drawn = j < count[:, None]  # (B, L)
    nxt = torch.where(drawn, (j + 1) % count.clamp(min=1)[:, None], j)  # (B, L) rank of the source
    sources = j.clone()
    return sources.scatter_(1, order, order.gather(1, nxt))


def gather_positions(x: Tensor, sources: Tensor) -> Tensor:
    """(B, L, ...) values -> the values at ``sources`` (B, L) along dim 1."""
    index = sources.reshape(*sources.shape, *([1] * (x.dim() - 2))).expand_as(x)
    return x.gather(1, index)


def video_vector(video: VideoEmbedding) -> Tensor:
    """(Nv, D) video-level vector: the pooled ``frame`` or the masked mean of the frame tokens."""
    if video.frame is not None and video.frame.dim() == 2:
        return video.frame
    tokens, mask = video.frame_tokens()  # (Nv, Lf, D), (Nv, Lf)
    weights = mask.to(tokens.dtype)[..., None]  # (Nv, Lf, 1)
    return (tokens * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)


# ---------------------------------------------------------------- the plug-in


@PLUGINS.register("ice")
class ICE(Plugin):
    """ICE (``ice``), IRM (``irm``) and TCP (``tcp``); see the module docstring.

    ``threshold``: the correlation threshold of ICE (in [-1, 1)); ``groups``:
    g of TCP; ``shuffle_ratio``: the fraction of shuffled positions (in
    [0, 1]); ``tcp_levels``: ``both`` | ``video`` | ``moment``;
    ``moment_branch`` / ``video_branch``: the backbone's moment-level and
    video-level branch names (``moment`` / ``video`` on ``ice_base``,
    ``clip`` / ``frame`` on GMMFormer, GMMFormer v2 and MS-SL).  All three
    parts off: the plug-in adds nothing (the baseline of Table 3).
    """

    switch_params = ("ice", "irm", "tcp")
    # TCP's shuffled videos come from encode_training (each rank's share); the mining and the classifiers
    # read encodings only, and the step hook's counts are divided by the ranks sharing the batch
    supports_global_batch = True

    def __init__(
        self,
        *,
        hidden_size: int,
        ice: bool = True,
        irm: bool = True,
        tcp: bool = True,
        threshold: float = 0.4,
        groups: int = 8,
        shuffle_ratio: float = 0.25,
        tcp_levels: Literal["both", "video", "moment"] = "both",
        moment_branch: str = "moment",
        video_branch: str = "video",
    ) -> None:
        super().__init__()
        check_positive_int(hidden_size, "hidden_size")
        self.ice = check_bool(ice, "ice")
        self.irm = check_bool(irm, "irm")
        self.tcp = check_bool(tcp, "tcp")
        self.threshold = check_number(threshold, "threshold", minimum=-1.0)
        if self.threshold >= 1.0:
            raise ValueError(f"threshold must be in [-1, 1), got {threshold!r}")
        self.groups = check_int(groups, "groups", minimum=2)
        self.shuffle_ratio = check_number(shuffle_ratio, "shuffle_ratio", minimum=0.0)
        if self.shuffle_ratio > 1.0:
            raise ValueError(f"shuffle_ratio must be in [0, 1], got {shuffle_ratio!r}")
        self.tcp_levels = check_choice(tcp_levels, "tcp_levels", TCP_LEVELS)
        self.moment_branch = check_identifier(moment_branch, "moment_branch", "'moment' or 'clip'")
        self.video_branch = check_identifier(video_branch, "video_branch", "'video' or 'frame'")
        if self.irm:
            self.redundancy = nn.Linear(hidden_size, hidden_size)  # the FC of Eq. 5, shared by r_v and r_q
        if self.tcp:
            if self.tcp_levels in ("both", "video"):
                self.video_classifier = nn.Linear(hidden_size, self.groups)
            if self.tcp_levels in ("both", "moment"):
                self.moment_classifier = nn.Linear(hidden_size, self.groups)
        init_normal_(self)
        self._reset_counts()

    def _reset_counts(self) -> None:
        self.__dict__["_counts"] = dict.fromkeys(("mined", "correct", "judged", "chance_hits", "chance_pairs"), 0.0)

    # ------------------------------------------------------------ contract

    def check_backbone(self, backbone: RetrievalModel, backbone_name: str) -> None:
        if not (self.ice or self.irm):
            return
        branches = list(getattr(backbone, "score_weights", {}))
        wanted = [("moment_branch", self.moment_branch)] + ([("video_branch", self.video_branch)] if self.irm else [])
        for key, branch in wanted:
            if branch not in branches:
                raise PluginError(
                    f"{key}: backbone '{backbone_name}' has no '{branch}' branch (branches: {', '.join(branches)}); "
                    "set plugins.ice.moment_branch / video_branch to its moment-level / video-level branch "
                    "(moment / video on ice_base, clip / frame on gmmformer, gmmformer_v2 and mssl)"
                )

    def needs(self, *, training: bool) -> frozenset[str]:
        """Training only: moment tokens (every part), frame tokens (IRM's v, TCP's video level)."""
        if not training:
            return frozenset()
        out = set()
        if self.ice or self.irm or (self.tcp and self.tcp_levels != "video"):
            out.add(MOMENT_TOKENS)
        if self.irm or (self.tcp and self.tcp_levels != "moment"):
            out.add(FRAME_TOKENS)
        return frozenset(out)

    def metric_names(self) -> tuple[str, ...]:
        ice = ("mined", "mined_total", "precision", "precision_chance")
        return (ice if self.ice else ()) + (("tcp_accuracy",) if self.tcp else ())

    def aux_keys(self) -> tuple[str, ...]:
        return tuple(key for part, keys in PART_KEYS.items() if getattr(self, part) for key in keys)

    def trained_parts(self) -> dict[str, tuple[str, ...]]:
        """IRM's FC and TCP's classifiers train only through L_irm and L_tcp (ICE mines without parameters)."""
        return {part: PART_KEYS[part] for part in ("irm", "tcp") if getattr(self, part)}

    # ------------------------------------------------------------ training extras

    def training_aux(self, batch: Batch, query: QueryEmbedding, video: VideoEmbedding) -> dict[str, Any]:
        aux: dict[str, Any] = {}
        query_video = batch.query_video.to(batch.frames.device)  # (Nq,)
        if self.ice:
            aux.update(self._ice(query, video, query_video))
        if self.irm:
            aux.update(self._irm(query, video, query_video))
        if self.tcp:
            aux.update(self._tcp(batch, video))
        return aux

    def encode_training(self, batch: Batch, video: VideoEmbedding) -> dict[str, Any]:
        """TCP's shuffled videos, from the batch's features: the source position of each frame and clip
        slot, and the host's encoding of the shuffled sequences (one row per video)."""
        if not self.tcp:
            return {}
        frame_src = shuffle_sources(batch.frame_mask.to(torch.bool), self.shuffle_ratio)  # (B, Lf)
        clip_mask = torch.ones(batch.clips.shape[:2], dtype=torch.bool, device=batch.clips.device)  # (B, Lc)
        clip_src = shuffle_sources(clip_mask, self.shuffle_ratio)  # (B, Lc)
        frames = gather_positions(batch.frames, frame_src)  # (B, Lf, Dv)
        clips = gather_positions(batch.clips, clip_src)  # (B, Lc, Dv)
        with self.host.training_exposure():
            shuffled = self.host.encode_videos(clips, frames, batch.frame_mask)
        return {"tcp_frame_src": frame_src, "tcp_clip_src": clip_src, "tcp_shuffled": shuffled}

    def _query_vector(self, query: QueryEmbedding, branch: str) -> Tensor:
        try:
            return query.vectors[branch]
        except KeyError:
            raise ValueError(
                f"ice: the model has no query vector for branch {branch!r}; available: {', '.join(query.vectors)}"
            ) from None

    def _ice(self, query: QueryEmbedding, video: VideoEmbedding, query_video: Tensor) -> dict[str, Tensor]:
        q = self._query_vector(query, self.moment_branch)  # (Nq, D)
        moments, mask = video.moment_tokens()  # (Nv, M, D), (Nv, M)
        nv, m, d = moments.shape
        flat = moments.reshape(nv * m, d)  # (n_m, D)
        moment_video = torch.arange(nv, device=q.device).repeat_interleave(m)  # (n_m,)
        with torch.no_grad():
            sim = cosine_matrix(flat, q)  # (n_m, Nq)
            sim = sim.masked_fill(~mask.reshape(-1, 1).to(sim.device), -2.0)  # padded moments never win
            own = moment_video[:, None] == query_video[None, :]  # (n_m, Nq)
            rows, texts = mutual_pairs(sim, own, self.threshold)  # (n_c,) each
        self.log_metric("mined", float(rows.numel()))
        return {
            "pair_moment": flat[rows],  # (n_c, D)
            "pair_query": q[texts],  # (n_c, D)
            "pair_video": moment_video[rows],  # (n_c,) the moment's video row
            "pair_text": texts,  # (n_c,) the text's query row
        }

    def _irm(self, query: QueryEmbedding, video: VideoEmbedding, query_video: Tensor) -> dict[str, Tensor]:
        q = self._query_vector(query, self.moment_branch)  # (Nq, D)
        q_video = self._query_vector(query, self.video_branch)  # (Nq, D)
        moments, mask = video.moment_tokens()  # (Nv, M, D), (Nv, M)
        own, own_mask = moments[query_video], mask[query_video]  # (Nq, M, D), (Nq, M)
        with torch.no_grad(), torch.autocast(device_type=q.device.type, enabled=False):  # fp32: see cosine_matrix
            cos = (F.normalize(own.float(), dim=-1, eps=_EPS) @ F.normalize(q.float(), dim=-1, eps=_EPS)[:, :, None])
            key = cos.squeeze(-1).masked_fill(~own_mask, -2.0).argmax(dim=1)  # (Nq,) Eq. 2
        rows = torch.arange(q.shape[0], device=q.device)
        key_moment = own[rows, key]  # (Nq, D)
        v = video_vector(video)[query_video]  # (Nq, D)
        return {
            "key_moment": key_moment,
            "query": q,
            "redundant_video": self.redundancy(v - key_moment),  # r_v (Nq, D)
            "redundant_query": self.redundancy(v - q_video),  # r_q (Nq, D)
        }

    def _tcp(self, batch: Batch, video: VideoEmbedding) -> dict[str, Tensor]:
        frame_mask = batch.frame_mask.to(torch.bool)  # (B, Lf)
        clip_mask = torch.ones(batch.clips.shape[:2], dtype=torch.bool, device=frame_mask.device)  # (B, Lc)
        frame_src, clip_src = video.extra["ice.tcp_frame_src"], video.extra["ice.tcp_clip_src"]  # (B, Lf), (B, Lc)
        shuffled = video.extra["ice.tcp_shuffled"]  # encode_training's
        levels = []
        if self.tcp_levels in ("both", "video"):
            levels.append((self.video_classifier, video.frame_tokens()[0], shuffled.frame_tokens()[0], frame_mask, frame_src))
        if self.tcp_levels in ("both", "moment"):
            original, shuffled_moments = video.moment_tokens()[0], shuffled.moment_tokens()[0]  # (B, M, D)
            if original.shape[1] != clip_mask.shape[1]:
                raise ValueError(
                    f"ice: TCP's moment level needs one moment token per clip ({clip_mask.shape[1]}), the backbone "
                    f"gives {original.shape[1]}; set plugins.ice.tcp_levels: video"
                )
            levels.append((self.moment_classifier, original, shuffled_moments, clip_mask, clip_src))
        logits, labels, parts = [], [], []
        for level, (classifier, original, moved, mask, src) in enumerate(levels):
            y_o = group_labels(mask, self.groups)  # (B, L)
            y_s = y_o.gather(1, src)  # (B, L) labels move with the features
            for part, (tokens, y) in enumerate(((original, y_o), (moved, y_s))):
                # every slot, padding zeroed and labelled -1 (ignored): no boolean indexing, so no host wait on a GPU
                logits.append(classifier(torch.where(mask[..., None], tokens, 0).flatten(0, 1)))  # (B*L, g)
                labels.append(y.flatten())  # (B*L,)
                parts.append(torch.full_like(labels[-1], 2 * level + part))
        out = {"tcp_logits": torch.cat(logits), "tcp_labels": torch.cat(labels), "tcp_part": torch.cat(parts)}
        shuffled = (out["tcp_part"] % 2 == 1) & (out["tcp_labels"] >= 0)  # real positions of the shuffled sequences
        correct = out["tcp_logits"].detach().argmax(dim=1) == out["tcp_labels"]
        hits = (correct & shuffled).sum().float()  # on the device
        self.log_metric("tcp_accuracy", hits / shuffled.sum().clamp(min=1))  # 0 without shuffled positions
        return out

    # ------------------------------------------------------------ ICE diagnostics

    def on_epoch_start(self, ctx: EpochContext) -> dict[str, float]:
        self._reset_counts()
        return {}

    def on_step_end(self, ctx: StepContext) -> None:
        if not self.ice:
            return
        videos, texts = ctx.output.aux["ice.pair_video"], ctx.output.aux["ice.pair_text"]  # (n_c,) each
        counts = self.__dict__["_counts"]
        share = 1.0 / ctx.ranks  # under a global batch every rank counts the same pairs: the epoch's sum is one count
        counts["mined"] += float(videos.numel()) * share
        truth = ctx.truth
        if truth is not None:  # on the host, but for the mined pairs' hits (summed on their device: no wait)
            relevant = truth.relevant(list(ctx.batch.query_ids), list(ctx.batch.video_ids))  # (Nq, Nv) bool, CPU
            query_video = torch.from_numpy(ctx.batch.host_query_video())  # (Nq,)
            unpaired = ~positive_mask(query_video, relevant.shape[1])  # (Nq, Nv)
            hits = host_to_device(relevant.numpy(), videos.device)[texts, videos]  # (n_c,)
            counts["correct"] = counts["correct"] + hits.sum(dtype=torch.float64) * share
            counts["judged"] += float(videos.numel()) * share
            counts["chance_hits"] += float((relevant & unpaired).sum()) * share
            counts["chance_pairs"] += float(unpaired.sum()) * share

    def on_epoch_end(self, ctx: EpochContext) -> dict[str, float]:
        if not self.ice:
            return {}
        counts = self.__dict__["_counts"]
        totals = ctx.all_reduce(
            torch.stack([torch.as_tensor(v, dtype=torch.float64).to(ctx.device) for v in counts.values()])
        )
        mined, correct, judged, chance_hits, chance_pairs = (float(t) for t in totals)
        out = {"mined_total": mined}
        if judged > 0:
            out["precision"] = correct / judged
        if chance_pairs > 0:
            out["precision_chance"] = chance_hits / chance_pairs
        self._reset_counts()
        return out
