"""RAL (Robust Alignment Learning, paper 000): MSRA + CSA on a backbone's frame branch.

MSRA (training only)
    Text units: with ``support="set"`` one per video of the batch, its *query
    support set* = the word tokens of all its queries concatenated (Eq. 5);
    with ``support="single"`` one per query (Table 4, X^q = Q).  Video units:
    one per video, its per-frame tokens.  Each unit's tokens X (n, D) are
    aggregated (Eqs. 6-7)::

        x_g = FC(mean_n X)                           global
        x_l = softmax_n(w2 . tanh(W1 X_n)) . X       local (gated attention)
        g   = LayerNorm(x_g + x_l)                   ("local"/"global": one term only)

    then ``mu = h_mu(g)``, ``logvar = h_logvar(g)`` (variances in log space;
    sigma = exp(logvar / 2); ``logvar_range: clamped`` clamps it to
    [``logvar_min``, ``logvar_max``], the official code does not).  That is ``heads:
    paper``; the default ``heads: official`` is the RAL-PRVR code's
    (:class:`OfficialGaussianEncoder`: a sigmoid-gated attention added to the
    pooled vector under LayerNorm for mu, its own attention plus the pooled
    vector for log sigma).  Proxies (Eq. 9, as the
    official code): ``num_proxies`` samples mu + sigma * eps, eps ~ N(0, I),
    i.e. (n, K, D); ``mean_proxy=True`` puts mu in front of them (n, K + 1, D);
    ``sampling=False`` uses the mean alone (n, 1, D).  The aux output also
    holds each unit's sample mean (mu without sampling), which the official
    L_DA uses in place of mu.
    With ``heads: official`` the attentions also run over the official
    support set's padding: every video's zero frames up to ``max_frames``
    (``heads_padding``) and, on the text side (``text_heads_padding``), each
    query's padded word positions holding the word encoder's outputs there
    plus zero rows up to ``support_pad_queries`` queries.
    Modules are separate per modality.  The aux outputs (``ral.*``) feed the
    ``ral_da`` and ``ral_pm`` losses; MSRA changes no score — its losses shape
    the backbone's frame and word tokens (the "robust Q and V_f" of appendix A).
    The geometric mean of sigma over units and dimensions is logged per epoch
    as ``train/ral.sigma_query`` / ``train/ral.sigma_video`` (Fig. 10), and
    the share of log sigma^2 values at or beyond [``logvar_min``,
    ``logvar_max``] (what ``logvar_range: clamped`` cuts) as
    ``train/ral.logvar_outside``.

CSA (training and retrieval)
    Word confidences g = masked softmax over the query's valid words of
    MLP(q_i) (Linear -> ReLU -> Linear(., 1)); ``csa_weighting="average"``
    uses 1 / #words instead (Fig. 8c).  The branch score becomes (Eqs. 11-12)
    ``S(q, v) = sum_i g_i * max_j cos(q_i, v_j)`` over v's real frames (padding
    never wins); its logits use the raw dot products q_i . v_j the same way.
    ``csa_input="normalized"`` (the official code) feeds the MLP the
    L2-normalised words for the score and the raw words for the logits;
    ``csa_input="raw"`` feeds it the raw words for both.
    q_i are word tokens, v_j the backbone's per-frame tokens, both in its
    hidden space.  ``word_encoder="own"`` (the official code's
    ``frame_branch_query_proj`` + ``frame_branch_query_encoder``: a second
    text encoder for the frame branch) encodes the words with the plug-in's
    own copy of the backbone's query encoder (freshly initialised, no pooling
    head, :meth:`RetrievalModel.fresh_word_encoder`), for CSA and MSRA alike;
    its positional embedding is the backbone query encoder's own module
    (``word_positions="shared"``, as the official ``query_pos_embed``) or a
    fresh one (``"own"``); ``word_encoder="backbone"`` reads the backbone's word tokens
    (``QueryEmbedding.tokens``).
    ``csa_padding="official"`` (the official code pads every video to the
    backbone's ``max_frames`` and scores its padded positions 0) floors each
    word's max at 0 for a video shorter than ``max_frames``, so padding wins
    when every real frame scores below 0; ``csa_padding="masked"``: the max
    over real frames only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from prvrlab.checks import check_bool, check_choice, check_identifier, check_int, check_number, check_positive_int
from prvrlab.data.batch import Batch, host_to_device
from prvrlab.models.base import BranchScores, QueryEmbedding, RetrievalModel, VideoEmbedding
from prvrlab.models.blocks import decay_norm_gains
from prvrlab.models.initialization import init_normal_
from prvrlab.models.component import FRAME_TOKENS, WORD_TOKENS
from prvrlab.models.layer_norm import LayerNorm
from prvrlab.models.plugins.base import Plugin, PluginError
from prvrlab.registry import PLUGINS

_MAX_CHUNK_ELEMENTS = 1 << 26  # bound on the (Nq, Lq, chunk, Lf) similarity tensor
_EPS = 1e-6


def masked_softmax(logits: Tensor, mask: Tensor, *, zero_slots: Tensor | None = None) -> Tensor:
    """Softmax over the last dim restricted to ``mask``; rows without a True are all zero.
    ``zero_slots`` (R,): per row, that many more entries of logit 0 in the normaliser (slots whose
    weights are not returned: the official RAL heads' zero-padded frames)."""
    logits = logits.float().masked_fill(~mask, float("-inf"))
    peak = logits.amax(dim=-1, keepdim=True)  # (R, 1)
    if zero_slots is not None:
        extra = zero_slots.to(logits.dtype)[:, None]  # (R, 1)
        peak = torch.where(extra > 0, peak.clamp(min=0.0), peak)
    peak = peak.clamp(min=torch.finfo(torch.float32).min)
    weights = torch.exp(logits - peak) * mask  # exp(-inf) = 0 on padding
    total = weights.sum(dim=-1, keepdim=True)  # (R, 1)
    if zero_slots is not None:
        total = total + extra * torch.exp(-peak.clamp(min=0.0))  # peak >= 0 wherever extra > 0
    return weights / total.clamp(min=1e-12)


def group_mean(tokens: Tensor, member: Tensor) -> Tensor:
    """(N, D) tokens, (G, N) bool membership -> (G, D) mean of each group's tokens (0 for an empty group)."""
    counts = member.sum(dim=1, keepdim=True).clamp(min=1)  # (G, 1)
    return (member.to(tokens.dtype) @ tokens) / counts  # (G, D)


def gated_attention(
    tokens: Tensor, member: Tensor, hidden: nn.Linear, score: nn.Linear, *, zero_slots: Tensor | None = None
) -> Tensor:
    """softmax over each group's tokens of ``score(tanh(hidden(x)))``, times the tokens: (G, D).
    ``zero_slots`` (G,): that many zero tokens more per group (bias-free layers give them logit 0; they
    add to the normaliser, not to the sum)."""
    gate = score(torch.tanh(hidden(tokens))).squeeze(-1)  # (N,)
    att = masked_softmax(gate[None, :].expand_as(member), member, zero_slots=zero_slots)  # (G, N)
    return att.to(tokens.dtype) @ tokens  # (G, D)


class MultiGranularityAggregator(nn.Module):
    """Groups of tokens -> one LayerNorm(global + local) vector per group (Eqs. 6-7)."""

    def __init__(self, *, hidden_size: int, aggregation: str) -> None:
        super().__init__()
        self.aggregation = aggregation
        if aggregation in ("both", "global"):
            self.global_fc = nn.Linear(hidden_size, hidden_size)
        if aggregation in ("both", "local"):
            self.gate_hidden = nn.Linear(hidden_size, hidden_size, bias=False)  # W1
            self.gate_score = nn.Linear(hidden_size, 1, bias=False)  # w2
        self.norm = LayerNorm(hidden_size)

    def forward(self, tokens: Tensor, member: Tensor) -> Tensor:
        """``tokens`` (N, D), ``member`` (G, N) bool token-in-group (a token in no group is ignored) -> (G, D)."""
        total = tokens.new_zeros(member.shape[0], tokens.shape[1])  # (G, D)
        if self.aggregation in ("both", "global"):
            total = total + self.global_fc(group_mean(tokens, member))
        if self.aggregation in ("both", "local"):
            total = total + gated_attention(tokens, member, self.gate_hidden, self.gate_score)
        return self.norm(total)


def bound_logvar(logvar: Tensor, clamp: tuple[float, float] | None) -> Tensor:
    """``logvar`` clamped to ``clamp`` = (min, max), or unchanged with ``None`` (the official code)."""
    return logvar if clamp is None else logvar.clamp(*clamp)


class GaussianEncoder(nn.Module):
    """Aggregator + mean and log-variance heads for one modality; ``logvar_clamp``: (min, max) or None."""

    def __init__(self, *, hidden_size: int, aggregation: str, logvar_clamp: tuple[float, float] | None) -> None:
        super().__init__()
        self.aggregate = MultiGranularityAggregator(hidden_size=hidden_size, aggregation=aggregation)
        self.mean = nn.Linear(hidden_size, hidden_size)
        self.logvar = nn.Linear(hidden_size, hidden_size)
        self.logvar_clamp = logvar_clamp

    def forward(self, tokens: Tensor, member: Tensor) -> tuple[Tensor, Tensor]:
        """(N, D) tokens, (G, N) membership -> mu (G, D), logvar (G, D)."""
        g = self.aggregate(tokens, member)
        return self.mean(g), bound_logvar(self.logvar(g), self.logvar_clamp)


class OfficialGaussianEncoder(nn.Module):
    """The RAL-PRVR code's heads for one modality (``heads: official``): two gated attentions of width
    D/2 over the group's tokens, one for each head, and a pooled vector p (video: the mean of the
    L2-normalised frames, normalised again; text: the plain mean of the support set's words)::

        mu       = LayerNorm(p + sigmoid(FC(att_mu(X))))      (PIENet)
        log sigma = FC(att_sigma(X)) + FC2(p)                  (UncertaintyModuleImage)

    returned as mu and logvar = 2 log sigma, unbounded as in the official code (``logvar_clamp``:
    (min, max) clamps it like the paper heads').  ``aggregation``: ``local`` drops p from both heads, ``global`` the attentions.
    ``zero_slots`` (G,) in ``forward``: zero tokens each group's attentions also run over (the
    official video heads see every video zero-padded to 128 frames); ``attend`` (G, N): the tokens the
    attentions run over where they are more than the pooled mean's ``member`` (the official text heads
    also attend over the text encoder's outputs at padded word positions)."""

    def __init__(
        self, *, hidden_size: int, aggregation: str, unit_pool: bool, logvar_clamp: tuple[float, float] | None
    ) -> None:
        super().__init__()
        width = max(1, hidden_size // 2)
        self.aggregation, self.unit_pool = aggregation, unit_pool
        if aggregation in ("both", "local"):
            self.mu_gate_hidden = nn.Linear(hidden_size, width, bias=False)
            self.mu_gate_score = nn.Linear(width, 1, bias=False)
            self.mu_fc = nn.Linear(hidden_size, hidden_size)
            self.sigma_gate_hidden = nn.Linear(hidden_size, width, bias=False)
            self.sigma_gate_score = nn.Linear(width, 1, bias=False)
            self.sigma_fc = nn.Linear(hidden_size, hidden_size)
        if aggregation in ("both", "global"):
            self.sigma_pool_fc = nn.Linear(hidden_size, hidden_size)
        self.mu_norm = LayerNorm(hidden_size)
        self.logvar_clamp = logvar_clamp

    def forward(
        self, tokens: Tensor, member: Tensor, *, zero_slots: Tensor | None = None, attend: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """(N, D) tokens, (G, N) membership -> mu (G, D), logvar (G, D)."""
        attend = member if attend is None else attend  # (G, N)
        mu_in = tokens.new_zeros(member.shape[0], tokens.shape[1])  # (G, D)
        log_sigma = torch.zeros_like(mu_in)  # (G, D)
        if self.aggregation in ("both", "global"):
            if self.unit_pool:
                pooled = F.normalize(group_mean(F.normalize(tokens, dim=-1), member), dim=-1)  # (G, D)
            else:
                pooled = group_mean(tokens, member)  # (G, D)
            mu_in = mu_in + pooled
            log_sigma = log_sigma + self.sigma_pool_fc(pooled)
        if self.aggregation in ("both", "local"):
            attended = gated_attention(tokens, attend, self.mu_gate_hidden, self.mu_gate_score, zero_slots=zero_slots)
            mu_in = mu_in + torch.sigmoid(self.mu_fc(attended))  # (G, D)
            attended = gated_attention(
                tokens, attend, self.sigma_gate_hidden, self.sigma_gate_score, zero_slots=zero_slots
            )  # (G, D)
            log_sigma = log_sigma + self.sigma_fc(attended)
        return self.mu_norm(mu_in), bound_logvar(2.0 * log_sigma, self.logvar_clamp)


def sample_proxies(mu: Tensor, logvar: Tensor, num_proxies: int, sampling: bool, *, mean_proxy: bool = False) -> Tensor:
    """(G, D) Gaussians -> (G, K, D) samples mu + sigma * eps_1..K, with ``mean_proxy`` (G, K + 1, D)
    [mu, samples]; (G, 1, D) [mu] without sampling."""
    if not sampling:
        return mu[:, None]
    std = torch.exp(0.5 * logvar)  # (G, D)
    eps = torch.randn(mu.shape[0], num_proxies, mu.shape[1], device=mu.device, dtype=mu.dtype)  # (G, K, D)
    samples = mu[:, None] + std[:, None] * eps  # (G, K, D)
    return torch.cat([mu[:, None], samples], dim=1) if mean_proxy else samples


def _groups(
    tokens: Tensor, mask: Tensor, row_group: Tensor, num_groups: int, *, padded: bool | None = None
) -> tuple[Tensor, Tensor]:
    """Padded (R, L, D) rows assigned to groups -> tokens (N, D) and their (G, N) group membership.

    ``padded`` (None: on any device but the CPU): every slot is kept (N = R*L), padding zeroed and in no
    group, so a GPU never tells the host how many tokens are real (boolean indexing would make it wait,
    forward and backward).  Else only the real tokens (fewer products: on a CPU nothing waits).  The
    Gaussians are the same either way, up to summation order."""
    if padded is None:
        padded = tokens.device.type != "cpu"
    token_group = row_group.repeat_interleave(mask.shape[1])  # (R*L,)
    groups = torch.arange(num_groups, device=tokens.device)  # (G,)
    if padded:
        flat = torch.where(mask[..., None], tokens, 0).reshape(-1, tokens.shape[-1])  # (R*L, D)
        return flat, (token_group[None, :] == groups[:, None]) & mask.reshape(1, -1)  # (G, R*L)
    real = mask.reshape(-1)  # (R*L,)
    return tokens.reshape(-1, tokens.shape[-1])[real], token_group[real][None, :] == groups[:, None]  # (N, D), (G, N)


def confidence_scores(
    words: Tensor,
    weights: Tensor,
    frames: Tensor,
    frame_mask: Tensor,
    *,
    with_logits: bool = False,
    logit_weights: Tensor | None = None,
    floor: Tensor | None = None,
) -> BranchScores:
    """S(q, v) = sum_i weights[q, i] * max over v's real frames j of cos(words[q, i], frames[v, j]).

    ``words`` (Nq, Lq, D), ``weights`` (Nq, Lq) (0 on padding), ``frames``
    (Nv, Lf, D), ``frame_mask`` (Nv, Lf) -> (Nq, Nv); logits use raw dots,
    weighted by ``logit_weights`` (Nq, Lq) when given, else by ``weights``.
    A video without real frames scores -1 (sim) and 0 (logits).  ``floor``
    (Nv,) bool: those videos' word maxima (sim and logits) are at least 0, as
    if padded positions scoring 0 took part.  fp32, chunked over videos.
    """
    nq, lq, dim = words.shape
    nv, lf, _ = frames.shape
    if nv == 0 or lf == 0 or nq == 0:
        empty = words.new_full((nq, nv), -1.0, dtype=torch.float32)
        return BranchScores(sim=empty, logits=torch.zeros_like(empty) if with_logits else None)
    chunk = max(1, _MAX_CHUNK_ELEMENTS // max(1, nq * lq * lf))
    sims, logits = [], []
    with torch.autocast(device_type=words.device.type, enabled=False):
        q = words.float().reshape(nq * lq, dim)  # (Nq*Lq, D)
        qn = F.normalize(q, dim=-1, eps=_EPS)
        w = weights.float()  # (Nq, Lq)
        wl = w if logit_weights is None else logit_weights.float()  # (Nq, Lq)
        for start in range(0, nv, chunk):
            v = frames[start : start + chunk].float()  # (C, Lf, D)
            c = v.shape[0]
            pad = ~frame_mask[start : start + chunk].to(torch.bool)  # (C, Lf)
            vn = F.normalize(v, dim=-1, eps=_EPS).reshape(c * lf, dim)
            low = None if floor is None else floor[start : start + chunk][None, None, :]  # (1, 1, C)
            cos = (qn @ vn.t()).view(nq, lq, c, lf).masked_fill(pad[None, None], -1.0)  # (Nq, Lq, C, Lf)
            top = cos.max(dim=-1).values  # (Nq, Lq, C)
            top = top if low is None else torch.where(low, top.clamp(min=0.0), top)
            sims.append((top * w[:, :, None]).sum(dim=1))  # (Nq, C)
            if with_logits:
                dots = (q @ v.reshape(c * lf, dim).t()).view(nq, lq, c, lf)  # (Nq, Lq, C, Lf)
                best = dots.masked_fill(pad[None, None], torch.finfo(torch.float32).min).max(dim=-1).values
                best = torch.where(pad.all(dim=1)[None, None, :], torch.zeros_like(best), best)  # (Nq, Lq, C)
                best = best if low is None else torch.where(low, best.clamp(min=0.0), best)
                logits.append((best * wl[:, :, None]).sum(dim=1))  # (Nq, C)
        sim = torch.cat(sims, dim=1)  # (Nq, Nv)
        return BranchScores(sim=sim, logits=torch.cat(logits, dim=1) if with_logits else None)


@PLUGINS.register("ral")
class RAL(Plugin):
    """MSRA (``msra``) and CSA (``csa``) on the backbone's ``branch`` (default ``frame``).

    ``num_proxies`` K samples per Gaussian; ``mean_proxy``: the mean as an
    extra first proxy; ``unit_mean``: L2-normalise each mean before sampling
    (the official code does; its raw-dot-product L_PM relies on it); ``sampling=False``: the mean only; ``support``: "set"
    (all of a video's queries) or "single";
    ``aggregation``: "both" | "local" | "global"; ``logvar_range``: log sigma^2
    unbounded ("official", as the RAL-PRVR code) or "clamped" to
    [``logvar_min``, ``logvar_max``]; ``csa_weighting``: "learned" | "average"; ``csa_hidden``:
    width of the confidence MLP (0: the backbone's hidden size);
    ``csa_input``: "normalized" (official) or "raw" words into that MLP;
    ``heads``: the Gaussian heads, "official" (:class:`OfficialGaussianEncoder`)
    or "paper" (Eqs. 6-7, :class:`GaussianEncoder`); ``heads_padding``: the
    official video heads' attentions also run over the zero frames that pad
    each video to the backbone's ``max_frames`` ("official": each adds logit 0
    to the normaliser) or over the real frames only ("masked"); only with
    ``heads: official``; ``text_heads_padding``: the official text heads'
    attentions also run over the plug-in's word encoder's outputs at the
    padded word positions of each query (padded to the batch's longest) and,
    with ``support: set``, over zero rows that pad each support set to
    ``support_pad_queries`` queries' worth ("official"), or over the real words
    only ("masked"); only with ``heads: official`` and ``word_encoder: own``;
    ``csa_padding``:
    "official" (a video shorter than the backbone's ``max_frames`` scores each
    word at least 0) or "masked"; ``word_encoder``: "own" (a text encoder of
    the plug-in's, as the official code) or "backbone" (the backbone's word
    tokens) (module docstring); ``word_positions``: that encoder's positional
    embedding, "shared" with the backbone's query encoder (the official
    layout) or its "own"; ``norm_decay``: the LayerNorm gains of the Gaussian
    heads and of the own word encoder's layers are weight-decayed, as the
    official optimiser groups them (its no-decay names, ``LayerNorm.weight``,
    miss PIENet's ``layer_norm`` and the encoder's ``norm1`` / ``norm2``);
    False exempts them (the word encoder's input projection and positional
    embedding norms are exempt under both).  With
    ``msra`` and ``csa`` both false the plug-in adds nothing and changes no
    score (the baseline cell of an ablation: the bare backbone's results).
    """

    corrected: ClassVar[dict[str, Any]] = {
        "csa_padding": "masked", "heads_padding": "masked", "text_heads_padding": "masked",
        "logvar_range": "clamped", "norm_decay": False,
    }  # the `corrected` preset (docs/parity.md)

    supports_global_batch = True  # training_aux reads the encodings, query_video and the query lengths only

    switch_params = ("msra", "csa")

    def __init__(
        self,
        *,
        hidden_size: int,
        msra: bool = True,
        csa: bool = True,
        num_proxies: int = 6,
        sampling: bool = True,
        mean_proxy: bool = False,
        unit_mean: bool = True,
        support: Literal["set", "single"] = "set",
        aggregation: Literal["both", "local", "global"] = "both",
        logvar_range: Literal["official", "clamped"] = "official",
        logvar_min: float = -10.0,
        logvar_max: float = 10.0,
        csa_weighting: Literal["learned", "average"] = "learned",
        csa_hidden: int = 0,
        csa_input: Literal["normalized", "raw"] = "normalized",
        heads: Literal["official", "paper"] = "official",
        heads_padding: Literal["official", "masked"] = "official",
        text_heads_padding: Literal["official", "masked"] = "official",
        support_pad_queries: int = 26,
        csa_padding: Literal["official", "masked"] = "official",
        word_encoder: Literal["own", "backbone"] = "own",
        word_positions: Literal["shared", "own"] = "shared",
        norm_decay: bool = True,
        branch: str = "frame",
    ) -> None:
        super().__init__()
        check_positive_int(hidden_size, "hidden_size")
        self.msra = check_bool(msra, "msra")
        self.csa = check_bool(csa, "csa")
        self.num_proxies = check_positive_int(num_proxies, "num_proxies")
        self.sampling = check_bool(sampling, "sampling")
        self.mean_proxy = check_bool(mean_proxy, "mean_proxy")
        self.unit_mean = check_bool(unit_mean, "unit_mean")
        self.support = check_choice(support, "support", ("set", "single"))
        self.aggregation = check_choice(aggregation, "aggregation", ("both", "local", "global"))
        self.csa_weighting = check_choice(csa_weighting, "csa_weighting", ("learned", "average"))
        self.csa_input = check_choice(csa_input, "csa_input", ("normalized", "raw"))
        self.heads = check_choice(heads, "heads", ("official", "paper"))
        self.heads_padding = check_choice(heads_padding, "heads_padding", ("official", "masked"))
        self.text_heads_padding = check_choice(text_heads_padding, "text_heads_padding", ("official", "masked"))
        self.support_pad_queries = check_positive_int(support_pad_queries, "support_pad_queries")
        self.csa_padding = check_choice(csa_padding, "csa_padding", ("official", "masked"))
        self.word_encoder = check_choice(word_encoder, "word_encoder", ("own", "backbone"))
        self.word_positions = check_choice(word_positions, "word_positions", ("shared", "own"))
        self.norm_decay = check_bool(norm_decay, "norm_decay")
        check_number(logvar_min, "logvar_min")
        check_number(logvar_max, "logvar_max")
        if not logvar_min < logvar_max:
            raise ValueError(f"logvar_min ({logvar_min!r}) must be < logvar_max ({logvar_max!r})")
        self.logvar_range = check_choice(logvar_range, "logvar_range", ("official", "clamped"))
        self.logvar_bounds = (float(logvar_min), float(logvar_max))
        clamp = self.logvar_bounds if self.logvar_range == "clamped" else None
        check_int(csa_hidden, "csa_hidden", minimum=0)  # 0: hidden_size
        self.branch = check_identifier(branch, "branch", "'frame'")
        if self.msra:
            kw = dict(hidden_size=hidden_size, aggregation=self.aggregation, logvar_clamp=clamp)
            if self.heads == "official":
                self.text_gaussian = OfficialGaussianEncoder(**kw, unit_pool=False)
                self.video_gaussian = OfficialGaussianEncoder(**kw, unit_pool=True)
            else:
                self.text_gaussian = GaussianEncoder(**kw)
                self.video_gaussian = GaussianEncoder(**kw)
        if self.csa and self.csa_weighting == "learned":
            width = csa_hidden or hidden_size
            self.confidence = nn.Sequential(nn.Linear(hidden_size, width), nn.ReLU(), nn.Linear(width, 1))
        init_normal_(self)
        decay_norm_gains(self, self.norm_decay)  # the heads' (the word encoder's: attach)

    # ------------------------------------------------------------ contract

    @property
    def text_grid(self) -> bool:
        """Whether the text heads read the word encoder's outputs at padded positions (the official layout)."""
        return self.msra and self.heads == "official" and self.text_heads_padding == "official"

    def check_backbone(self, backbone: RetrievalModel, backbone_name: str) -> None:
        if self.text_grid and self.word_encoder != "own":
            raise PluginError(
                "plugins.ral.text_heads_padding: official reads the plug-in's own word encoder's outputs at "
                "padded word positions, which word_encoder: backbone does not have; set "
                "plugins.ral.text_heads_padding: masked (or word_encoder: own)"
            )
        branches = list(getattr(backbone, "score_weights", {}))
        if self.branch not in branches:
            raise PluginError(
                f"RAL works on a frame-level branch with per-frame embeddings; backbone '{backbone_name}' "
                f"has no '{self.branch}' branch (branches: {', '.join(branches)}); "
                "use it with gmmformer, gmmformer_v2 or mssl, or set plugins.ral.branch"
            )
        for key, used in (("csa_padding", self.csa), ("heads_padding", self.msra and self.heads == "official")):
            if used and getattr(self, key) == "official" and not isinstance(getattr(backbone, "max_frames", None), int):
                raise PluginError(
                    f"plugins.ral.{key}: official pads every video to the backbone's max_frames, which "
                    f"backbone '{backbone_name}' does not have; set plugins.ral.{key}: masked"
                )

    def attach(self, backbone: RetrievalModel, *, make_backbone: Callable[[], RetrievalModel] | None) -> None:
        """Keeps the backbone; with ``word_encoder: own``, builds the plug-in's text encoder from it."""
        super().attach(backbone, make_backbone=make_backbone)
        if (self.csa or self.msra) and self.word_encoder == "own":
            shared = self.word_positions == "shared"
            self.words = backbone.fresh_word_encoder(share_positions=shared)  # optimised and checkpointed
            if isinstance(getattr(self.words, "layers", None), nn.Module):  # the plug-in's switch, not the copy's
                decay_norm_gains(self.words.layers, self.norm_decay)
            if self.text_grid and not callable(getattr(self.words, "encode_padded", None)):
                raise PluginError(
                    f"plugins.ral.text_heads_padding: official needs outputs at padded word positions, which "
                    f"{type(self.words).__name__} (the backbone's fresh_word_encoder) cannot give (no "
                    "encode_padded); set plugins.ral.text_heads_padding: masked"
                )

    def needs(self, *, training: bool) -> frozenset[str]:
        """Frame tokens (and the backbone's word tokens unless the plug-in has its own encoder) for CSA
        (always) and MSRA (training only)."""
        if not (self.csa or (self.msra and training)):
            return frozenset()
        return frozenset({FRAME_TOKENS}) if self.word_encoder == "own" else frozenset({WORD_TOKENS, FRAME_TOKENS})

    def encode_queries(self, queries: Tensor, query_mask: Tensor, query: QueryEmbedding) -> dict[str, Tensor]:
        """With ``word_encoder: own``: the plug-in's word tokens ``ral.words`` (Nq, Lq, D) and their mask
        (for CSA, and in the training forward for MSRA); with the official text padding, in the training
        forward, also ``ral.word_grid`` (Nq, Lq, D): the encoder's outputs at every slot, padding included."""
        training = self.host.training_time()
        if "words" not in self._modules or not (self.csa or training):
            return {}
        if training and self.text_grid:
            mask = query_mask.to(torch.bool)  # (Nq, Lq)
            zeroed = torch.where(mask[..., None], queries, 0)  # the official collate pads with zero features
            grid = self.words.encode_padded(zeroed, mask)  # (Nq, Lq, D)
            return {"words": torch.where(mask[..., None], grid, 0), "word_mask": mask, "word_grid": grid}
        t, packing = self.words.encode(queries, query_mask)  # (Nt, D)
        return {"words": packing.unpack(t), "word_mask": packing.mask}

    def word_tokens(self, query: QueryEmbedding) -> tuple[Tensor, Tensor]:
        """(Nq, Lq, D) word tokens and their (Nq, Lq) bool mask: the plug-in's own, else the backbone's."""
        if "ral.words" in query.extra:
            return query.extra["ral.words"], query.extra["ral.word_mask"].to(torch.bool)
        return query.word_tokens()

    def metric_names(self) -> tuple[str, ...]:
        return ("sigma_query", "sigma_video", "logvar_outside") if self.msra else ()

    def trained_parts(self) -> dict[str, tuple[str, ...]]:
        """MSRA's Gaussian heads feed only its training outputs (L_DA, L_PM)."""
        return {"msra": self.aux_keys()} if self.msra else {}

    def aux_keys(self) -> tuple[str, ...]:
        if not self.msra:
            return ()
        return (
            "text_mu",
            "text_logvar",
            "video_mu",
            "video_logvar",
            "text_video",
            "text_proxies",
            "video_proxies",
            "text_sample_mean",
            "video_sample_mean",
        )

    # ------------------------------------------------------------ CSA

    def word_weights(self, tokens: Tensor, mask: Tensor, *, normalize: bool | None = None) -> Tensor:
        """(Nq, Lq) confidences g: softmax over each query's valid words (zero on padding).

        ``normalize`` (default: ``csa_input == "normalized"``) L2-normalises the
        words before the MLP.
        """
        mask = mask.to(torch.bool)
        if self.csa_weighting == "average":
            return mask.float() / mask.sum(dim=1, keepdim=True).clamp(min=1)
        if normalize is None:
            normalize = self.csa_input == "normalized"
        if normalize:
            tokens = F.normalize(tokens, dim=-1, eps=_EPS)  # (Nq, Lq, D)
        return masked_softmax(self.confidence(tokens).squeeze(-1), mask)

    def adjust_scores(
        self, query: QueryEmbedding, video: VideoEmbedding, scores: dict[str, BranchScores], *, with_logits: bool
    ) -> dict[str, BranchScores]:
        if not self.csa:
            return scores
        words, word_mask = self.word_tokens(query)  # (Nq, Lq, D), (Nq, Lq)
        frames, frame_mask = video.frame_tokens()  # (Nv, Lf, D), (Nv, Lf)
        weights = self.word_weights(words, word_mask)  # (Nq, Lq)
        logit_weights = None
        if with_logits and self.csa_input == "normalized":
            logit_weights = self.word_weights(words, word_mask, normalize=False)  # (Nq, Lq) official: raw words
        floor = None
        if self.csa_padding == "official":  # the official code's padded positions (up to max_frames) score 0
            floor = frame_mask.sum(dim=1) < self.host.max_frames  # (Nv,)
        out = dict(scores)
        out[self.branch] = confidence_scores(
            words, weights, frames, frame_mask, with_logits=with_logits, logit_weights=logit_weights, floor=floor
        )
        return out

    # ------------------------------------------------------------ MSRA

    def training_aux(self, batch: Batch, query: QueryEmbedding, video: VideoEmbedding) -> dict[str, Tensor]:
        if not self.msra:
            return {}
        words_padded, word_mask = self.word_tokens(query)  # (Nq, Lq, D), (Nq, Lq)
        frames, frame_mask = video.frame_tokens()  # (Nv, Lf, D), (Nv, Lf)
        num_videos = frames.shape[0]
        if self.support == "set":
            host = batch.host_query_video()  # (Nq,) read on the host: no wait for the device
            counts = np.bincount(host, minlength=num_videos)  # (B,) queries per video
            present = counts > 0
            slot = np.cumsum(present) - 1  # video -> its text unit
            layout = host_to_device(np.concatenate([np.flatnonzero(present), slot[host], counts[present]]), frames.device)
            num_units = int(present.sum())
            text_video, row_group, unit_size = layout.split([num_units, host.shape[0], num_units])  # (T,), (Nq,), (T,)
        else:
            text_video = batch.query_video.to(frames.device)  # (T = Nq,)
            num_units = text_video.shape[0]
            row_group = torch.arange(num_units, device=frames.device)
            unit_size = None  # one query per unit, no zero rows
        if self.text_grid:
            text_mu, text_logvar = self._text_heads_on_the_grid(batch, query, word_mask, row_group, num_units, unit_size)
        else:
            words, member_q = _groups(words_padded, word_mask, row_group, num_units)
            text_mu, text_logvar = self.text_gaussian(words, member_q)  # (T, D) each
        frame_slots, member_v = _groups(frames, frame_mask, torch.arange(num_videos, device=frames.device), num_videos)
        padding = {}
        if self.heads == "official" and self.heads_padding == "official":  # every video padded to max_frames
            padding["zero_slots"] = (self.host.max_frames - frame_mask.sum(dim=1)).clamp(min=0)  # (B,)
        video_mu, video_logvar = self.video_gaussian(frame_slots, member_v, **padding)  # (B, D) each
        if self.unit_mean:
            text_mu, video_mu = F.normalize(text_mu, dim=-1), F.normalize(video_mu, dim=-1)
        aux = {
            "text_mu": text_mu,
            "text_logvar": text_logvar,
            "video_mu": video_mu,
            "video_logvar": video_logvar,
            "text_video": text_video,
        }
        for side, mu, logvar in (("text", text_mu, text_logvar), ("video", video_mu, video_logvar)):
            proxies = sample_proxies(mu, logvar, self.num_proxies, self.sampling, mean_proxy=self.mean_proxy)
            aux[f"{side}_proxies"] = proxies  # (G, P, D)
            samples = proxies[:, 1:] if self.sampling and self.mean_proxy else proxies  # (G, K or 1, D)
            aux[f"{side}_sample_mean"] = samples.mean(dim=1)  # (G, D)
        # geometric mean of sigma = exp(mean(log sigma)) over units and dimensions (Fig. 10)
        self.log_metric("sigma_query", torch.exp(0.5 * text_logvar.detach().float().mean()))
        self.log_metric("sigma_video", torch.exp(0.5 * video_logvar.detach().float().mean()))
        lo, hi = self.logvar_bounds
        both = torch.cat([text_logvar.detach().reshape(-1), video_logvar.detach().reshape(-1)])  # (T*D + B*D,)
        self.log_metric("logvar_outside", ((both <= lo) | (both >= hi)).float().mean())
        return aux

    def _text_heads_on_the_grid(
        self,
        batch: Batch,
        query: QueryEmbedding,
        word_mask: Tensor,
        row_group: Tensor,
        num_units: int,
        unit_size: Tensor | None,
    ) -> tuple[Tensor, Tensor]:
        """The official text heads: each unit's pooled mean over its real words; its attentions over all
        Lo slots of each of its n queries (Lo: the batch's longest query; the slots past a query's end hold
        the encoder's outputs there) and, given ``unit_size`` (T,) = n (``support: set``),
        (support_pad_queries - n) * Lo zero rows more (the official support set is zero-padded to 26 * Lo
        rows).  ``row_group`` (Nq,): each query's unit of the ``num_units`` (T).  -> mu, logvar (T, D) each."""
        if "ral.word_grid" not in query.extra:
            raise PluginError("RAL's official text heads need ral.word_grid from the training forward's encode_queries")
        host = batch.query_lengths_host
        longest = int(host.max(initial=0)) if host is not None else int(word_mask.sum(dim=1).max())
        grid = query.extra["ral.word_grid"][:, :longest]  # (Nq, Lo, D)
        tokens = grid.reshape(-1, grid.shape[-1])  # (Nq*Lo, D)
        units = torch.arange(num_units, device=tokens.device)  # (T,)
        attend = row_group.repeat_interleave(longest)[None, :] == units[:, None]  # (T, Nq*Lo)
        member = attend & word_mask[:, :longest].reshape(1, -1)  # (T, Nq*Lo) the real words
        padding = {}
        if unit_size is not None:
            padding["zero_slots"] = ((self.support_pad_queries - unit_size) * longest).clamp(min=0)  # (T,)
        return self.text_gaussian(tokens, member, attend=attend, **padding)
