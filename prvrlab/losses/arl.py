"""ARL's ambiguity-aware objective (Cho et al., AAAI 2025, Eqs. 8-12), text-video and text-frame.

Reads the ``arl`` plug-in's training outputs (``out.aux["arl.*"]``): per
encoder m the text-frame cosines s^f (Nq, Nv, Lf) with gradient, its best
frames k_hat (Nq, Nv), and the ambiguity masks it is trained with (its own,
or with ``cross_model`` the other encoder's).  s = s^f at k_hat (Eq. 3).
Every positive pair (q_i, V_j) of the batch (j = video(i); n = N_q pairs) is
an anchor.

Text-video (L_video), with A the detected pairs minus positives and N the
rest of the unpaired ones::

    t2v_i = -log( (e^s_ij + sum_{a in A^q_i} e^s_ia) / (e^s_ij + sum_{v in A^q_i u N^q_i} e^s_iv) )   (Eq. 8)
    v2t_ij = -log( (e^s_ij + sum_{a in A^v_j} e^s_aj) / (e^s_ij + sum_{q in A^v_j u N^v_j} e^s_qj) )  (Eq. 9)
    L_nce = 1/n sum_(i,j) t2v_i + v2t_ij                                                             (Eq. 10)
    L_a^trip = 1/n sum [m_a + s(q_a, V_j) - s_ij]_+ + [m_a + s(q_i, V_a) - s_ij]_+                    (Eq. 11)
    L_n^trip = 1/n sum [m + s(q_n, V_j) - s_ij]_+ + [m + s(q_i, V_n) - s_ij]_+                        (Eq. 12)
    L_video = lambda_nce L_nce + L_a^trip + L_n^trip

The other queries of V_j (also positives of V_j) are neither ambiguous nor
negative for the pair (q_i, V_j), so they are left out of Eq. 9's sums.

Text-frame (L_frame, same formulas, same lambda_nce; only after warm-up and
with the plug-in's ``text_frame``): the paper applies Eqs. 6-12 "between the
query feature and video frame features ... for each video" without saying
what the positive frame is; ours: for the pair (q_i, V_j) the positive is
v_j,k_hat (the frame giving s_ij), t2f candidates are V_j's other real
frames, and f2t candidates for the anchor frame v_j,k_hat are the batch's
queries except those of V_j whose own k_hat is the same frame (its
positives, left out as in Eq. 9).  Ambiguous frames / queries are the
plug-in's text-frame mask at those pairs.

Eq. 11-12 write one q_a, V_a, q_n, V_n per anchor; from epoch
``hard_negative_start_epoch`` (0-based) we take the hardest (highest-scoring)
member of each set (VSE++, which the paper cites for the triplet), before it
one member drawn uniformly (the schedule of GMMFormer's triplet, whose
"typical parameters" the paper adopts: hardest negatives from the first step
leave a freshly initialised model at chance); an empty set contributes 0.
Eq. 8 exponentiates the cosine s itself (no temperature), as written.

``ambiguous`` (Table 6): ``ours`` as above; ``positive``: a supervised
contrastive term (Khosla et al.) with the ambiguous members as extra
positives, -1/|P| sum_{p in P} log(e^s_p / (e^s_ij + sum_{A u N} e^s)), and
L_n^trip only; ``ignore``: the ambiguous members are masked out of every
term (plain NCE over the positive and N, L_n^trip only).  With empty sets
(warm-up, or the plug-in's switches off) all three are the base losses:
InfoNCE on s plus the triplet with margin m (a drawn member before
``hard_negative_start_epoch``, the hardest from then on).

With ``cross_model`` the loss is the sum over the two encoders, each with
the sets the other detected.  Metrics: ``video`` and ``frame`` (the two
objectives of the first encoder; ``frame`` is 0 before it is on).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from prvrlab.checks import check_choice, check_identifier, check_int, check_number
from prvrlab.data.batch import Batch
from prvrlab.losses._common import plugin_aux, positive_mask
from prvrlab.losses.base import Loss
from prvrlab.losses.triplet import sample_negatives
from prvrlab.models.base import ModelOutput
from prvrlab.registry import LOSSES

Usage = Literal["ours", "positive", "ignore"]
USAGES: tuple[str, ...] = ("ours", "positive", "ignore")


def _masked(scores: Tensor, mask: Tensor) -> Tensor:
    return scores.masked_fill(~mask, float("-inf"))


def ambiguity_nce(positive: Tensor, candidates: Tensor, ambiguous: Tensor, negative: Tensor, usage: str) -> Tensor:
    """Per-anchor multi-positive NCE (Eqs. 8-9 and Table 6's alternatives).

    ``positive`` (n,) s of each anchor's pair, ``candidates`` (n, C) the
    scores of its candidates, ``ambiguous`` / ``negative`` (n, C) disjoint
    bool masks (anything in neither is left out) -> (n,).
    """
    pos = positive[:, None]  # (n, 1)
    if usage == "ignore":
        ambiguous = torch.zeros_like(ambiguous)
    denominator = torch.logsumexp(torch.cat([pos, _masked(candidates, ambiguous | negative)], dim=1), dim=1)  # (n,)
    if usage == "positive":
        count = 1 + ambiguous.sum(dim=1)  # (n,)
        total = positive + (candidates * ambiguous).sum(dim=1)  # (n,) sum of log-numerators
        return denominator - total / count
    numerator = torch.logsumexp(torch.cat([pos, _masked(candidates, ambiguous)], dim=1), dim=1)  # (n,)
    return denominator - numerator


def _member_hinge(margin: float, positive: Tensor, candidates: Tensor, members: Tensor, hard: bool) -> Tensor:
    """[margin + s(member) - positive]_+ per anchor, 0 without a member: the hardest member when ``hard``,
    else one drawn uniformly from the global RNG (as :class:`TripletLoss` before its hard-negative epoch)."""
    if hard:
        chosen = _masked(candidates, members).amax(dim=1)  # (n,)
    else:
        drawn = sample_negatives(candidates, members, None).clamp(min=0)  # (n,); -1 (no member) masked below
        chosen = candidates.gather(1, drawn[:, None]).squeeze(1)  # (n,)
    some = members.any(dim=1)  # (n,)
    hinge = (margin + torch.where(some, chosen, positive) - positive).clamp(min=0)
    return hinge * some


def ambiguity_triplet(
    positive: Tensor,
    candidates: Tensor,
    ambiguous: Tensor,
    negative: Tensor,
    *,
    margin: float,
    ambiguous_margin: float,
    usage: str,
    hard: bool = True,
) -> Tensor:
    """Per-anchor dual triplet (Eqs. 11-12): ambiguous hinge (``ours`` only) + negative hinge -> (n,);
    ``hard``: each set's hardest member, else a uniformly drawn one."""
    loss = _member_hinge(margin, positive, candidates, negative, hard)
    if usage == "ours":
        loss = loss + _member_hinge(ambiguous_margin, positive, candidates, ambiguous, hard)
    return loss


def _level(
    pairs: list[tuple[Tensor, Tensor, Tensor, Tensor]],
    *,
    lambda_nce: float,
    margin: float,
    ambiguous_margin: float,
    usage: str,
    hard: bool,
) -> Tensor:
    """lambda_nce L_nce + L_a^trip + L_n^trip of one level from its two directions' anchor rows."""
    n = pairs[0][0].shape[0]
    nce = sum(ambiguity_nce(*p, usage) for p in pairs)  # (n,)
    trip = sum(
        ambiguity_triplet(*p, margin=margin, ambiguous_margin=ambiguous_margin, usage=usage, hard=hard) for p in pairs
    )
    return (lambda_nce * nce + trip).sum() / max(n, 1)


def video_rows(
    sim: Tensor, query_video: Tensor, sets: Tensor
) -> list[tuple[Tensor, Tensor, Tensor, Tensor]]:
    """Anchor rows (positive, candidates, ambiguous, negative) of t2v and v2t for s (Nq, Nv)."""
    nq, nv = sim.shape
    rows = torch.arange(nq, device=sim.device)
    paired = positive_mask(query_video, nv)  # (Nq, Nv)
    positive = sim[rows, query_video]  # (Nq,)
    t2v_amb = sets & ~paired
    t2v = (positive, sim, t2v_amb, ~paired & ~t2v_amb)
    cand = sim[:, query_video].t()  # (Nq anchors, Nq candidates): s(q, V_video(i))
    unpaired = ~paired[:, query_video].t()  # (Nq, Nq): q not a query of V_video(i)
    v2t_amb = sets[:, query_video].t() & unpaired
    v2t = (positive, cand, v2t_amb, unpaired & ~v2t_amb)
    return [t2v, v2t]


def frame_rows(
    frame_sim: Tensor, frame_mask: Tensor, k_hat: Tensor, query_video: Tensor, sets: Tensor
) -> list[tuple[Tensor, Tensor, Tensor, Tensor]]:
    """Anchor rows of t2f and f2t (see the module docstring); ``frame_sim`` / ``sets`` (Nq, Nv, Lf)."""
    nq = frame_sim.shape[0]
    rows = torch.arange(nq, device=frame_sim.device)
    own_k = k_hat[rows, query_video]  # (Nq,) positive frame of each query in its video
    positive = frame_sim[rows, query_video, own_k]  # (Nq,)
    own = frame_sim[rows, query_video]  # (Nq, Lf)
    others = frame_mask[query_video].clone()  # (Nq, Lf)
    others.scatter_(1, own_k[:, None], False)  # a scatter: no host copy of the value on a GPU
    t2f_amb = sets[rows, query_video] & others
    t2f = (positive, own, t2f_amb, others & ~t2f_amb)
    cand = frame_sim[:, query_video, own_k].t()  # (Nq anchors, Nq candidates): s^f(q, v_j,k_hat_i)
    same = (query_video[None, :] == query_video[:, None]) & (own_k[None, :] == own_k[:, None])  # (Nq, Nq)
    f2t_amb = sets[:, query_video, own_k].t() & ~same
    f2t = (positive, cand, f2t_amb, ~same & ~f2t_amb)
    return [t2f, f2t]


@LOSSES.register("arl")
class ARLLoss(Loss):
    """L_video (+ L_frame) of every encoder of the ``arl`` plug-in; see the module docstring.

    ``lambda_nce``: the NCE weight of both levels; ``margin`` m and
    ``ambiguous_margin`` m_a < m of the dual triplet; ``ambiguous``: how the
    ambiguous sets are used (Table 6); ``hard_negative_start_epoch``: the
    first (0-based) epoch whose triplets take each set's hardest member
    (before it a uniformly drawn one; 0: hardest throughout; default 20, the
    ``triplet`` loss's); ``plugin``: the plug-in's name.
    """

    def __init__(
        self,
        *,
        lambda_nce: float = 0.02,
        margin: float = 0.2,
        ambiguous_margin: float = 0.1,
        ambiguous: Usage = "ours",
        hard_negative_start_epoch: int = 20,
        plugin: str = "arl",
    ) -> None:
        super().__init__()
        self.lambda_nce = check_number(lambda_nce, "lambda_nce", minimum=0.0)
        self.margin = check_number(margin, "margin", minimum=0.0)
        self.ambiguous_margin = check_number(ambiguous_margin, "ambiguous_margin", minimum=0.0)
        if not self.ambiguous_margin < self.margin:
            raise ValueError(f"ambiguous_margin ({ambiguous_margin!r}) must be < margin ({margin!r}): m_a < m (Eq. 11-12)")
        self.ambiguous = check_choice(ambiguous, "ambiguous", USAGES)
        self.hard_negative_start_epoch = check_int(hard_negative_start_epoch, "hard_negative_start_epoch", minimum=0)
        self.plugin = check_identifier(plugin, "plugin", "'arl'")

    def required_aux(self) -> tuple[str, ...]:
        keys = ("frame_mask", "frame_on", "frame_sim0", "best_frame0", "video_sets0", "frame_sets0")
        return tuple(f"{self.plugin}.{k}" for k in keys)

    def metric_names(self) -> tuple[str, ...]:
        return ("video", "frame")

    def forward(self, out: ModelOutput, batch: Batch, *, epoch: int) -> Tensor:
        frame_mask, frame_on = plugin_aux(out, self.required_aux()[:2], "arl")
        frame_mask = frame_mask.to(torch.bool)
        query_video = batch.query_video.to(frame_mask.device)
        kw = dict(
            lambda_nce=self.lambda_nce, margin=self.margin, ambiguous_margin=self.ambiguous_margin, usage=self.ambiguous,
            hard=epoch >= self.hard_negative_start_epoch,
        )
        total = None
        for m in (0, 1):
            if m == 1 and f"{self.plugin}.frame_sim1" not in out.aux:
                break
            keys = tuple(f"{self.plugin}.{k}{m}" for k in ("frame_sim", "best_frame", "video_sets", "frame_sets"))
            frame_sim, k_hat, video_sets, frame_sets = plugin_aux(out, keys, "arl")
            frame_sim = frame_sim.float()  # (Nq, Nv, Lf)
            sim = frame_sim.gather(2, k_hat[..., None]).squeeze(-1)  # (Nq, Nv): s (Eq. 3)
            video = _level(video_rows(sim, query_video, video_sets), **kw)
            frame = sim.sum() * 0.0
            if bool(frame_on):
                frame = _level(frame_rows(frame_sim, frame_mask, k_hat, query_video, frame_sets), **kw)
            if m == 0:
                self.log_metric("video", video)
                self.log_metric("frame", frame)
            total = video + frame if total is None else total + video + frame
        assert total is not None
        return total
