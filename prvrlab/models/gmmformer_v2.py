"""GMMFormer v2 (Wang et al., 2024): TC-GMMBlocks, a frame-level branch, max-over-time scoring.

Query: InputProjection -> positional embedding -> one transformer layer ->
attention pooling -> one (Nq, D) vector shared by both branches (as the
reference code; the paper's Sec. 3.1).  Clip branch: clips -> InputProjection
-> positional embedding -> ``num_blocks`` TC-GMMBlocks -> (B, Lc, D); score =
max cosine over the clips.  Frame branch: frames -> InputProjection ->
positional embedding -> TC-GMMBlocks (padding skipped) -> (B, Lf, D) with a
mask; score = max cosine over the frames (``frame_padding: official``: over
all ``max_frames`` positions, padding scoring 0, as the reference code;
``masked``: over the real frames only, REFERENCE.md section 9).

A TC-GMMBlock runs K Gaussian-constrained transformer layers in parallel on
the same input (one per width in ``sigmas``; ``inf`` = plain attention), each
``y_k = LN2_k(h_k + FFN_k(h_k))`` with ``h_k = LN1_k(x + GaussAttn_k(x))``
(post-norm, FFN ``Linear -> ReLU -> Dropout -> Linear`` of width ``ffn_size``,
per-branch weights), and then aggregates the K outputs with one of the
paper's strategies (Table 4):

* ``average``  - the mean over branches (GMMFormer's static aggregation, AP);
* ``learned``  - softmax(w / tau) with one learned logit per branch (WA);
* ``dynamic``  - per-video branch weights: a learned query vector phi
  cross-attends to each branch's output, a linear layer maps each summary to
  one logit, softmax over branches at temperature tau (DA);
* ``temporal`` - temporal consolidation (TCM, the paper's default): the same
  cross-attention summaries, an MLP maps each to one logit per time step
  (``max_frames`` outputs, the first L used), softmax over branches at every
  time step at temperature tau (Eqs. 1-3).

The cross-attention uses one query (phi), so it is computed without
projecting any key: ``q . W_k x = (W_k^T q) . x`` per head, and the values are
projected after pooling (``sum_j a_j W_v x_j = W_v sum_j a_j x_j``), which
makes its cost negligible next to the branches.

The layers follow the reference code (``model_components.py``) by default:
every self- and cross-attention closes with ``LN(x + Dropout(heads))``, no
output projection (``BertAttention`` / ``BertCrossAttention``); every FFN is
``Linear -> ReLU -> Dropout -> Linear`` (``FeedForward``; the cross-attention's
is D wide); the cross-attention's probabilities get ``attention_dropout``
like every other attention's; one weight token phi serves every TC-GMMBlock,
clip and frame (``model.py``'s ``weight_token``).  What prvrlab built before
checkpoint format 8 is one switch each (docs/parity.md): ``attention_output:
projected`` (a learned D x D output projection after the branches', query
layer's and cross-attention's heads), ``query_activation: gelu``,
``ffn_dropout: false``, ``cross_attention_dropout: false``, ``weight_token:
per_block``; files written before format 8 are evaluated with those
(``BEFORE_FORMAT[8]``).  Every fast path serves both settings: the
projection is the last step of :class:`~prvrlab.models.gmm.GaussianAttention`
(skipped without it), the FFN dropout runs inside
:func:`~prvrlab.models.blocks.branch_mlp`'s per-branch GEMMs (its draw taken
with the residual ones, so activation checkpointing keeps the masks), the
cross-attention's dropout on its (B, L, K, H) probabilities.  The backbone's
``attention_dropout`` default is 0 (the reference ties it to ``drop``; the
dataset configs set it).  The paper's appendix writes the Gaussian blocks
pre-norm, the reference code (followed here) post-norm.  The Gaussian windows
follow the reference by default (``window: official`` over the padded span,
``max_frames`` for frames); ``window: centred`` with ``window_length: real``
centres each row on its diagonal and spans each video's real length.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from prvrlab.checks import check_bool, check_choice, check_layer_count, check_number, check_positive_int
from prvrlab.models import branch_mix, summary_pool
from prvrlab.models.base import BranchScores, QueryEmbedding, RetrievalModel, VideoEmbedding
from prvrlab.models.blocks import (
    AttentionPooling,
    BackboneSizes,
    BranchLinear,
    Dropout,
    PackedLayer,
    Packing,
    autocast_input,
    branch_layer_norm,
    branch_mlp,
    check_score_weights,
    decay_norm_gains,
    dropout_draw,
    legacy_encoder_keys,
    residual_dropout_draw,
    resolve_ffn_size,
)
from prvrlab.models.initialization import init_normal_
from prvrlab.models.component import FRAME_TOKENS, MOMENT_TOKENS, WORD_TOKENS
from prvrlab.models.gmm import (
    GaussianAttention,
    TransformerLayer,
    Window,
    WindowLength,
    check_window,
    ffn_inner,
    parse_sigmas,
)
from prvrlab.models.layer_norm import LayerNorm
from prvrlab.models.scoring import index_token_norms, indexed_norms, indexed_score_elements, max_scores
from prvrlab.registry import BACKBONES

Aggregation = Literal["average", "learned", "dynamic", "temporal"]
AGGREGATIONS: tuple[str, ...] = ("average", "learned", "dynamic", "temporal")
V2_SIGMAS: tuple[float, ...] = (0.1, 0.5, 1.0, 3.0, 5.0, 8.0, 10.0, math.inf)


def check_tcgmm_ffn_size(ffn_size: int | None, hidden_size: int) -> int:
    """``ffn_size`` resolved as everywhere (None: 4 * hidden_size); a TC-GMMBlock needs one (not 0)."""
    ffn = resolve_ffn_size(ffn_size, hidden_size)
    if ffn == 0:
        raise ValueError("ffn_size must be > 0 or None here: every TC-GMMBlock branch has a feed-forward sublayer")
    return ffn


class LearnedQueryAttention(nn.Module):
    """A learned query vector phi cross-attends to each branch's output sequence.

    Input (K, N, D) packed branch outputs; output (B, K, D): one summary per
    video and branch, ``LN2(s + FFN(s))`` with ``s = LN1(phi + MHA(phi, X_k))``
    (multi-head attention over the real tokens only; a transformer
    cross-attention layer with one query, as the reference's block-aware CA,
    ``BertCrossAttention``).  The FFN is D -> D -> D with ReLU (the
    reference's ``FeedForward(D, int(1 * D))``).  ``out_projection``: a
    learned output projection ``W_o`` after the heads (the reference has
    none); ``ffn_dropout``: dropout (rate ``dropout``) after the FFN's ReLU
    (the reference's); ``attention_dropout``: dropout on the attention
    probabilities (the reference's ``attention_probs_dropout_prob``).  The
    defaults are the reference's, ``attention_dropout`` aside (the backbone
    passes its own).
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int,
        dropout: float,
        out_projection: bool = False,
        ffn_dropout: bool = True,
        attention_dropout: float = 0.0,
    ) -> None:
        super().__init__()
        check_bool(out_projection, "out_projection")
        check_bool(ffn_dropout, "ffn_dropout")
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.phi = nn.Parameter(torch.randn(hidden_size))  # N(0, 1) as the reference's weight token
        self.query = nn.Linear(hidden_size, hidden_size)
        self.key = nn.Linear(hidden_size, hidden_size, bias=False)  # a key bias cancels in the softmax
        self.value = nn.Linear(hidden_size, hidden_size)
        self.out = nn.Linear(hidden_size, hidden_size) if out_projection else None
        self.norm1 = LayerNorm(hidden_size)
        inner = ffn_inner("relu", dropout if ffn_dropout else 0.0)  # ffn.0 / ffn.2 either way
        self.ffn = nn.Sequential(nn.Linear(hidden_size, hidden_size), inner, nn.Linear(hidden_size, hidden_size))
        self.norm2 = LayerNorm(hidden_size)
        self.dropout = Dropout(dropout)
        self.attn_dropout = Dropout(attention_dropout, name="attention_dropout")
        self._token_owner: list[tuple[nn.Module, str]] = []

    @property
    def token(self) -> Tensor:
        """The learned query token: this layer's ``phi``, or the owner's parameter :meth:`use_token` named."""
        if self.phi is not None:
            return self.phi
        owner, name = self._token_owner[0]
        return getattr(owner, name)

    def use_token(self, owner: nn.Module, name: str) -> None:
        """Read the query token from ``owner``'s parameter ``name`` (the backbone's shared ``weight_token``),
        read at every call (so a parameter the owner swaps in is followed), instead of an own ``phi``,
        which is dropped (no ``phi`` key then).  A plain list holds the owner: not registered here, so the
        parameter is listed, optimised and checkpointed once."""
        self.register_parameter("phi", None)
        self._token_owner = [(owner, name)]

    def forward(self, x: Tensor, packing: Packing) -> Tensor:
        """(K, N, D) packed branch outputs -> (B, K, D) summaries."""
        K, N, D = x.shape
        B, L, H, Dh = packing.batch, packing.length, self.num_heads, self.head_dim
        # F.linear rather than self.query(phi): module hooks (e.g. FlopCounterMode's) choke on a bare leaf input
        phi = self.token  # (D,)
        q = F.linear(phi, self.query.weight, self.query.bias).view(H, Dh)  # (H, Dh)
        # logits_h(j) = (W_k x_j)_h . q_h / sqrt(Dh) = x_j . (W_k,h^T q_h) / sqrt(Dh)
        u = torch.einsum("hed,he->hd", self.key.weight.view(H, Dh, D), q) / math.sqrt(Dh)  # (H, D)
        logits = torch.matmul(x, u.t().to(x.dtype))  # (K, N, H)
        logits = packing.unpack(logits.transpose(0, 1).reshape(N, K * H)).view(B, L, K, H).float()  # (B, L, K, H)
        if not packing.is_full:
            pad = ~packing.mask[:, :, None, None]  # (B, L, 1, 1)
            logits = logits.masked_fill(pad, torch.finfo(logits.dtype).min)
        probs = torch.softmax(logits, dim=1)  # (B, L, K, H)
        if not packing.is_full:
            probs = probs * packing.mask[:, :, None, None]  # rows without real tokens pool to zero
        probs = self.attn_dropout(probs)  # (B, L, K, H); identity at inference or rate 0
        if summary_pool.takes(x):  # bf16 on a CPU: each video's packed tokens pooled in place (summary_pool.py)
            weights = packing.pack(probs.to(x.dtype)).transpose(0, 1)  # (K, N, H)
            pooled = summary_pool.pool(weights, x, summary_pool.segment_offsets(packing))  # (K, B, H, D)
        else:
            # the tokens unpacked branch-major: each (branch, video) product reads a contiguous (L, D) block, where
            # a (B, L, K, D) layout was copied to (B, K, L, D) for the products and its gradient copied back
            # (forward + backward of v2's (8, ~9.8k, 384) branches over 128 videos: 1.19x bf16, 1.22x fp32)
            padded = packing.unpack(x, dim=1)  # (K, B, L, D)
            pooled = torch.matmul(probs.permute(2, 0, 3, 1).to(padded.dtype), padded)  # (K, B, H, D)
        w_v = self.value.weight.view(H, Dh, D)
        ctx = torch.einsum("kbhd,hed->bkhe", pooled, w_v.to(pooled.dtype))  # (B, K, H, Dh)
        bias = self.value.bias.to(ctx.dtype).view(H, Dh)
        if self.training and self.attn_dropout.p > 0:
            # sum_j p_j (W x_j + b) = W (sum_j p_j x_j) + b sum_j p_j: dropped weights no longer sum to 1, so
            # each head's bias is scaled by its weights' sum, as the reference's value rows carry it
            bias = probs.sum(dim=1).to(ctx.dtype)[..., None] * bias  # (B, K, H, Dh)
        ctx = (ctx + bias).reshape(B, K, D)  # (B, K, D)
        if self.out is not None:
            ctx = self.out(ctx)
        s = self.norm1(phi + self.dropout(ctx))  # (B, K, D)
        return self.norm2(s + self.dropout(self.ffn(s)))  # (B, K, D)


class TCGMMBlock(PackedLayer):
    """K parallel Gaussian-constrained transformer layers and their aggregation (see the module docstring).

    The K branches share one fused Q/K/V projection (:class:`GaussianAttention`)
    and run their output projections and FFNs as batched GEMMs
    (:class:`BranchLinear`); token-wise work runs on packed real tokens.
    ``max_len`` bounds the sequence length (the temporal consolidation has one
    output per time step); ``window`` / ``window_length``: the Gaussian
    windows (:mod:`prvrlab.models.gmm`).  ``out_projection``: a learned output
    projection after each branch's and the cross-attention's heads (the
    reference has none); ``ffn_dropout``: dropout (rate ``dropout``) after
    the ReLU inside each branch's and the cross-attention's FFN (the
    reference's); ``cross_attention_dropout``: ``attention_dropout`` on the
    cross-attention's probabilities too (the reference's).  The defaults are
    the reference's.
    """

    norm_parameters: ClassVar[tuple[str, ...]] = ("norm1_weight", "norm1_bias", "norm2_weight", "norm2_bias")
    checkpoint_activations: bool = False  # train.checkpoint_activations (see branches_packed)

    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int = 4,
        sigmas: Sequence[float | str] = V2_SIGMAS,
        dropout: float = 0.1,
        attention_dropout: float = 0.0,
        ffn_size: int | None = None,
        aggregation: Aggregation = "temporal",
        tau: float = 0.6,
        max_len: int = 128,
        window: Window = "official",
        window_length: WindowLength = "padded",
        out_projection: bool = False,
        ffn_dropout: bool = True,
        cross_attention_dropout: bool = True,
    ) -> None:
        super().__init__()
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {', '.join(AGGREGATIONS)}, got {aggregation!r}")
        check_bool(cross_attention_dropout, "cross_attention_dropout")
        self.ffn_dropout = check_bool(ffn_dropout, "ffn_dropout")
        window_args = {"window": window, "window_length": window_length}
        self.attention = GaussianAttention(
            hidden_size=hidden_size,
            num_heads=num_heads,
            sigmas=sigmas,
            dropout=attention_dropout,
            out_projection=out_projection,
            **window_args,
        )
        K = self.attention.num_branches
        F_ = check_tcgmm_ffn_size(ffn_size, hidden_size)
        self.aggregation = aggregation
        self.tau = check_number(tau, "tau", minimum=0, strict=True)
        self.max_len = check_positive_int(max_len, "max_len")
        self.dropout = Dropout(dropout)
        self.norm1_weight = nn.Parameter(torch.ones(K, hidden_size))
        self.norm1_bias = nn.Parameter(torch.zeros(K, hidden_size))
        self.ffn_in = BranchLinear(num_branches=K, in_dim=hidden_size, out_dim=F_)
        self.ffn_out = BranchLinear(num_branches=K, in_dim=F_, out_dim=hidden_size)
        self.norm2_weight = nn.Parameter(torch.ones(K, hidden_size))
        self.norm2_bias = nn.Parameter(torch.zeros(K, hidden_size))
        self.clip_parts = {name: K for name in self.norm_parameters}  # one LayerNorm per branch in the reference
        self.branch_logits: nn.Parameter | None = None
        self.summary: LearnedQueryAttention | None = None
        self.weight_head: nn.Module | None = None
        if aggregation == "learned":
            self.branch_logits = nn.Parameter(torch.zeros(K))  # uniform at start
        elif aggregation in ("dynamic", "temporal"):
            self.summary = LearnedQueryAttention(
                hidden_size=hidden_size,
                num_heads=num_heads,
                dropout=dropout,
                out_projection=out_projection,
                ffn_dropout=ffn_dropout,
                attention_dropout=attention_dropout if cross_attention_dropout else 0.0,
            )
            out = 1 if aggregation == "dynamic" else max_len
            self.weight_head = nn.Sequential(
                nn.Linear(hidden_size, hidden_size), nn.ReLU(), Dropout(dropout), nn.Linear(hidden_size, out)
            )

    @property
    def sigmas(self) -> tuple[float, ...]:
        return self.attention.sigmas

    def branches_packed(self, x: Tensor, packing: Packing) -> Tensor:
        """(N, D) packed tokens -> (K, N, D): every branch's output before aggregation.

        With ``checkpoint_activations`` (and autograd recording) the branches run one at a time under
        :func:`torch.utils.checkpoint.checkpoint`: only the input and each branch's output are kept for
        the backward, which recomputes one branch at a time, so the backward holds one branch's
        (B, H, L, L) attention maps and (N, ffn_size) activations instead of all K.  The dropout draws
        are taken first, in the order and shapes of the one-pass run, so both give the same result
        (tests/models/test_fast_paths.py).
        """
        p = self.dropout.p if self.training else 0.0
        # Under autocast the (K, N, D) residual stream stays in the autocast dtype (LayerNorm keeps its
        # input's dtype and accumulates in float32): no float32 <-> bf16 copies of the largest tensors.
        x = autocast_input(x)  # (N, D)
        F_ = self.ffn_in.weight.shape[1]
        inner = p > 0 and self.ffn_dropout  # dropout after the FFNs' ReLU: a (K, N, F) draw after the two (K, N, D)
        if not (self.checkpoint_activations and torch.is_grad_enabled()):
            a = self.attention.forward_packed(x, packing)  # (K, N, D)
            # deferred: the residuals' masks are applied forward and backward without being written (bf16 CPU)
            draws = [dropout_draw(a.shape, p, a.device, deferred=True) for _ in range(2)] if p > 0 else [None, None]
            # the FFN's: deferred, multiplied into its ReLU output without being written
            draws.append(dropout_draw((*a.shape[:2], F_), p, a.device, deferred=True) if inner else None)  # (K, N, F)
            return self._close_branches(x, a, slice(None), *draws)  # (K, N, D)
        K, N, D = self.attention.num_branches, x.shape[0], x.shape[-1]
        attn = self.attention
        attn_p = attn.attn_dropout.p if self.training else 0.0
        shape = (packing.batch, K, attn.num_heads, packing.length, packing.length)
        attn_draw = dropout_draw(shape, attn_p, x.device) if attn_p > 0 else None  # (B, K, H, L, L)
        # kept until the backward as seeds (deferred draws: the same masks as the one-pass run's)
        draws = [dropout_draw((K, N, D), p, x.device, deferred=True) if p > 0 else None for _ in range(2)]  # (K, N, D) each
        draws.append(dropout_draw((K, N, F_), p, x.device, deferred=True) if inner else None)  # (K, N, F)
        outs = []
        for k in range(K):
            branch = slice(k, k + 1)
            args = [None if d is None else d[branch] for d in draws]
            args.insert(0, None if attn_draw is None else attn_draw[:, branch])
            outs.append(checkpoint(self._branch, x, packing, branch, *args, use_reentrant=False))  # (1, N, D)
        return torch.cat(outs)  # (K, N, D)

    def _branch(self, x: Tensor, packing: Packing, branches: slice, attn_draw, *draws) -> Tensor:
        """The ``branches`` (k of them) of :meth:`branches_packed` from pre-taken dropout draws: (N, D) -> (k, N, D)."""
        a = self.attention.forward_packed(x, packing, branches, attn_draw)  # (k, N, D)
        return self._close_branches(x, a, branches, *draws)

    def _close_branches(self, x: Tensor, a: Tensor, branches: slice, a_draw, f_draw, h_draw=None) -> Tensor:
        """Residual, LayerNorm, FFN, residual, LayerNorm of the ``branches``' attention outputs (k, N, D);
        ``h_draw`` (k, N, F): the draw of the dropout inside the FFN (``ffn_dropout``)."""
        p = self.dropout.p
        h = residual_dropout_draw(x, a, a_draw, p) if a_draw is not None else a + x  # (k, N, D)
        w1, b1 = self.norm1_weight[branches].to(h.dtype), self.norm1_bias[branches].to(h.dtype)
        h = branch_layer_norm(h, w1, b1)  # (k, N, D)
        f = branch_mlp(h, self.ffn_in, self.ffn_out, branches, h_draw, p)  # (k, N, D) through (k, N, F)
        h = residual_dropout_draw(h, f, f_draw, p) if f_draw is not None else h + f  # (k, N, D)
        w2, b2 = self.norm2_weight[branches].to(h.dtype), self.norm2_bias[branches].to(h.dtype)
        return branch_layer_norm(h, w2, b2)  # (k, N, D)

    def branch_weights(self, branches: Tensor, packing: Packing) -> Tensor | None:
        """Float32 aggregation weights summing to 1 over branches: (N, K) per token, (K,) for
        ``learned`` (the same for every token), None for ``average``."""
        if self.aggregation == "average":
            return None
        if self.aggregation == "learned":
            return torch.softmax(self.branch_logits.float() / self.tau, dim=0)  # (K,)
        summary = self.summary(branches, packing)  # (B, K, D)
        logits = self.weight_head(summary).float()  # (B, K, 1) or (B, K, max_len)
        rows = packing.rows()  # (N,)
        if self.aggregation == "dynamic":
            per_token = logits.squeeze(-1)[rows]  # (N, K)
        else:
            if packing.length > self.max_len:
                raise ValueError(
                    f"sequence length {packing.length} exceeds the temporal consolidation's max_len={self.max_len}"
                )
            per_token = logits.transpose(1, 2)[rows, packing.positions]  # (N, K)
        return torch.softmax(per_token / self.tau, dim=-1)  # (N, K)

    def forward_packed(self, x: Tensor, packing: Packing) -> Tensor:
        """(N, D) packed tokens -> (N, D) aggregated."""
        branches = self.branches_packed(x, packing)  # (K, N, D)
        weights = self.branch_weights(branches, packing)  # (N, K) or None
        if weights is None:
            return branches.mean(dim=0)  # (N, D)
        if weights.dim() == 1:
            return torch.einsum("k,knd->nd", weights.to(branches.dtype), branches)  # (N, D)
        return branch_mix.mix(weights.to(branches.dtype), branches)  # (N, D)


@BACKBONES.register("gmmformer_v2")
class GMMFormerV2(RetrievalModel):
    """GMMFormer v2: TC-GMMBlock clip and frame branches, both scored by max cosine over time.

    ``sigmas``: Gaussian widths of the branches (``"inf"``: plain attention);
    ``aggregation``: how a TC-GMMBlock merges its branches (``temporal`` =
    the paper's temporal consolidation; ``average`` / ``learned`` /
    ``dynamic`` = the alternatives of its Table 4); ``tau``: softmax
    temperature of the branch weights (0.09 TVR, 0.6 ActivityNet / Charades);
    ``num_blocks``: TC-GMMBlocks per video branch; ``ffn_size``: width of the
    feed-forward sublayer of every branch and of the query encoder (None: 4 *
    hidden_size, as the reference; 0, no feed-forward sublayer, is refused:
    a TC-GMMBlock always has one); ``clip_weight`` / ``frame_weight``: the
    branches' weights in the retrieval score; ``window``: the Gaussian
    window's offsets (``official``: ``j/(L-1) - i/L`` as the reference,
    ``centred``: ``(j-i)/(L-1)``); ``window_length``: its span L
    (``padded``: the clip count for clips and ``max_frames`` for frames, as
    the reference; ``real``: each video's real length), see
    :mod:`prvrlab.models.gmm`; ``frame_padding``: ``official`` scores the
    frame branch as the reference, a max over all ``max_frames`` positions
    where padding scores 0 (so padding wins whenever every real frame scores
    below 0), ``masked``: a max over real frames only; ``norm_decay``: the
    LayerNorm gains of the attention layers (the query encoder's two, each
    branch's two, the temporal consolidation's cross-attention's two) are
    weight-decayed, as the reference's optimiser groups them (its no-decay
    names, ``LayerNorm.weight``, miss its modules named ``norm1`` / ``norm2``);
    False exempts them like the input projections' and positional
    embeddings' norms (exempt under both).  The layers follow the
    reference's ``BertAttention`` / ``BertCrossAttention`` / ``FeedForward``
    by default; each difference prvrlab had before checkpoint format 8 is a
    switch (docs/parity.md): ``attention_output``: ``official`` closes every
    self- and cross-attention with ``LN(x + Dropout(heads))``, no output
    projection, as the reference; ``projected`` adds a learned D x D output
    projection (N(0, 0.02)) to the branches', query layer's and
    cross-attention's heads; ``query_activation``: the query layer's FFN
    activation, ``relu`` as the reference or ``gelu``; ``ffn_dropout``:
    dropout (rate ``dropout``) after the ReLU inside every FFN (branches,
    query layer, cross-attention), as the reference's ``FeedForward``; False:
    none; ``cross_attention_dropout``: ``attention_dropout`` on the
    temporal / dynamic consolidation's cross-attention probabilities too, as
    the reference (whose ``attention_probs_dropout_prob`` is every
    attention's); False: none there; ``weight_token``: ``shared``, one
    learned query token phi for every TC-GMMBlock (clip and frame), as the
    reference's single ``weight_token`` passed to both blocks (one tensor
    held as the backbone's ``weight_token``); ``per_block``: each block
    learns its own (``summary.phi``); ``query_redraw``: in training, the queries
    are encoded a second time (another dropout draw) and that vector is the
    training-only query branch ``redrawn``, as the reference's ``forward``
    encodes them again for its query-diverse and optimal-matching losses
    (whose ``branch: redrawn`` reads it; False: no second encoding, and those
    losses read ``clip``, the vector the scores use).  Encoders: ``query``,
    ``clip`` and ``frame`` (:class:`SequenceEncoder`).
    """

    corrected: ClassVar[dict[str, Any]] = {
        "window": "centred", "window_length": "real", "frame_padding": "masked", "norm_decay": False,
    }  # the `corrected` preset (docs/parity.md)

    provides = frozenset({FRAME_TOKENS, WORD_TOKENS, MOMENT_TOKENS})  # frame and clip embeddings are always per item
    legacy_keys = {
        **legacy_encoder_keys("query", layers="query_encoder", single_layer=True, pool="query_pool"),
        **legacy_encoder_keys("clip", layers="clip_blocks"),
        **legacy_encoder_keys("frame", layers="frame_blocks"),
    }

    def __init__(
        self,
        *,
        video_dim: int,
        query_dim: int,
        hidden_size: int = 384,
        num_heads: int = 4,
        dropout: float = 0.1,
        attention_dropout: float = 0.0,
        ffn_size: int | None = None,
        sigmas: list[float | str] = [0.1, 0.5, 1.0, 3.0, 5.0, 8.0, 10.0, "inf"],  # noqa: B006 - never mutated
        aggregation: Aggregation = "temporal",
        tau: float = 0.6,
        num_blocks: int = 1,
        max_frames: int = 128,
        max_query_len: int = 30,
        clip_weight: float = 0.7,
        frame_weight: float = 0.3,
        window: Window = "official",
        window_length: Literal["padded", "real"] = "padded",
        frame_padding: Literal["official", "masked"] = "official",
        norm_decay: bool = True,
        attention_output: Literal["official", "projected"] = "official",
        query_activation: Literal["relu", "gelu"] = "relu",
        ffn_dropout: bool = True,
        cross_attention_dropout: bool = True,
        weight_token: Literal["shared", "per_block"] = "shared",
        query_redraw: bool = False,
    ) -> None:
        super().__init__()
        sizes = BackboneSizes(
            video_dim=video_dim,
            query_dim=query_dim,
            hidden_size=hidden_size,
            num_heads=num_heads,
            dropout=dropout,
            attention_dropout=attention_dropout,
            max_frames=max_frames,
            max_query_len=max_query_len,
        )
        ffn = check_tcgmm_ffn_size(ffn_size, hidden_size)
        self.sigmas = parse_sigmas(sigmas)
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {', '.join(AGGREGATIONS)}, got {aggregation!r}")
        self.aggregation = aggregation
        self.tau = check_number(tau, "tau", minimum=0, strict=True)
        check_layer_count(num_blocks, "num_blocks")
        self.score_weights = check_score_weights({"clip": clip_weight, "frame": frame_weight})
        self.hidden_size, self.max_frames, self.max_query_len = hidden_size, max_frames, max_query_len

        check_window(window, window_length)
        self.window, self.window_length = window, window_length
        if frame_padding not in ("official", "masked"):
            raise ValueError(f"frame_padding must be 'official' or 'masked', got {frame_padding!r}")
        self.frame_padding = frame_padding
        self.attention_output = check_choice(attention_output, "attention_output", ("official", "projected"))
        self.query_activation = check_choice(query_activation, "query_activation", ("relu", "gelu"))
        self.ffn_dropout = check_bool(ffn_dropout, "ffn_dropout")
        self.cross_attention_dropout = check_bool(cross_attention_dropout, "cross_attention_dropout")
        self.weight_token = check_choice(weight_token, "weight_token", ("shared", "per_block"))
        projected = attention_output == "projected"

        def block(span: WindowLength) -> TCGMMBlock:
            return TCGMMBlock(
                **sizes.layer_args,
                sigmas=self.sigmas,
                ffn_size=ffn,
                aggregation=aggregation,
                tau=tau,
                max_len=max_frames,
                window=window,
                window_length=span,
                out_projection=projected,
                ffn_dropout=ffn_dropout,
                cross_attention_dropout=cross_attention_dropout,
            )

        def query_layer() -> TransformerLayer:
            return TransformerLayer(
                **sizes.layer_args,
                ffn_size=ffn,
                ffn_activation=query_activation,
                ffn_dropout=ffn_dropout,
                out_projection=projected,
            )

        self.query = sizes.query_encoder(query_layer, pool=lambda: AttentionPooling(hidden_size=hidden_size))
        clip_span, frame_span = ("padded", max_frames) if window_length == "padded" else ("real", "real")
        self.clip = sizes.video_encoder(lambda: block(clip_span), num_layers=num_blocks)  # clips are never padded
        self.frame = sizes.video_encoder(lambda: block(frame_span), num_layers=num_blocks)
        summaries = [layer.summary for enc in (self.clip, self.frame) for layer in enc.layers if layer.summary is not None]
        self.weight_token: nn.Parameter | None = None
        if weight_token == "shared" and summaries:  # the blocks read this one parameter (no summary.phi keys)
            self.weight_token = nn.Parameter(torch.randn(hidden_size))  # N(0, 1) as the reference's
            for summary in summaries:
                summary.use_token(self, "weight_token")
        self.norm_decay = check_bool(norm_decay, "norm_decay")
        self.query_redraw = check_bool(query_redraw, "query_redraw")
        for encoder in (self.query, self.clip, self.frame):
            decay_norm_gains(encoder.layers, self.norm_decay)
        init_normal_(self)  # Linear/Embedding/BranchLinear only: phi keeps its N(0, 1) draw

    def encode_videos(self, clips: Tensor, frames: Tensor, frame_mask: Tensor) -> VideoEmbedding:
        """(B, Lc, Dv) clips, (B, Lf, Dv) frames, (B, Lf) mask -> clip (B, Lc, D), frame (B, Lf, D) + mask."""
        clip = self.clip(clips)  # (B, Lc, D)
        f, frame_packing = self.frame.encode(frames, frame_mask)  # (Nf, D)
        return VideoEmbedding(
            clip=clip,
            frame=frame_packing.unpack(f),  # (B, Lf, D), zeros on padding
            frame_mask=frame_packing.mask,  # (B, Lf)
        )

    def encode_queries(self, queries: Tensor, query_mask: Tensor) -> QueryEmbedding:
        """(Nq, Lq, Dq) tokens with (Nq, Lq) mask -> one (Nq, D) vector shared by both branches."""
        return self.query.embed(
            queries, query_mask, branches=("clip", "frame"), keep_tokens=self.keeps_word_tokens()
        )

    score_elements = staticmethod(indexed_score_elements)
    low_precision_fields = ("clip", "frame")  # max-scored, indexed by index_token_norms

    def encode_budget_share(self) -> float:
        """4 / K for K Gaussian branches (GMMFormer's blocks have 4): the (K, N, D) branch activations make
        the working set grow with K (8 branches, 17 TVR videos: 0.25 GiB, the peak of an evaluation at
        TVR's test size; 8 videos: 0.12 GiB)."""
        return min(1.0, 4 / len(self.sigmas))

    def index_videos(self, video: VideoEmbedding) -> VideoEmbedding:
        """Adds the clips' and frames' norms (:func:`~prvrlab.models.scoring.index_token_norms`)."""
        return index_token_norms(video, ("clip", "frame"))

    def score(
        self, query: QueryEmbedding, video: VideoEmbedding, *, with_logits: bool = False
    ) -> dict[str, BranchScores]:
        """Clip: max over clips; frame: max over real frames (cosine; logits: the raw dot products)."""
        if video.clip is None or video.frame is None or video.frame.dim() != 3:
            raise ValueError("GMMFormerV2.score needs VideoEmbedding.clip and per-frame VideoEmbedding.frame")
        frame = max_scores(
            query.vectors["frame"], video.frame, video.frame_mask, with_logits=with_logits,
            video_norm=indexed_norms(video, "frame"),
        )  # (Nq, Nv)
        if self.frame_padding == "official":  # padded positions (up to max_frames) score 0 in the max
            padded = (video.frame_mask.sum(dim=1) < self.max_frames)[None, :]  # (1, Nv)
            frame = BranchScores(
                sim=torch.where(padded, frame.sim.clamp(min=0.0), frame.sim),
                logits=None if frame.logits is None else torch.where(padded, frame.logits.clamp(min=0.0), frame.logits),
            )
        return {
            "clip": max_scores(
                query.vectors["clip"], video.clip, with_logits=with_logits, video_norm=indexed_norms(video, "clip")
            ),  # (Nq, Nv)
            "frame": frame,  # (Nq, Nv)
        }
