"""Mamba (Gu & Dao, 2023): the selective scan and the Mamba mixer block, in plain PyTorch.

The selective state-space recurrence over a sequence of length L, per channel
e (E channels) with an N-dimensional state::

    h_t = exp(delta_t,e A_e) * h_{t-1} + delta_t,e x_t,e B_t      (N,)
    y_t,e = <C_t, h_t> + D_e x_t,e

with ``x``, ``delta`` (B, L, E), ``A`` (E, N) (negative), input-dependent
``B``, ``C`` (B, L, N) and the skip ``D`` (E,).

* :func:`selective_scan_reference` runs it step by step (the definition; tests).
* :func:`selective_scan_chunked` (:class:`_ChunkedScan`) runs the same
  recurrence in blocks of a few sequences x ``chunk`` steps, small enough that
  a block's (chunk, rows, N, E) decays and states stay in the CPU's cache: per
  block, the decays ``exp(delta A)`` (all <= 1: no exp of a positive number
  anywhere), the inputs ``delta x B``, ``chunk`` in-place steps from the state
  entering the chunk, and ``y = C . h`` as one batched matrix product.  Only
  the state entering each chunk, (L / chunk) x (B, N, E), is kept; the
  hand-written backward recomputes a chunk's states from it and runs the
  adjoint recurrence backwards (class docstring), so memory is the inputs
  plus O(B N E L / chunk) instead of autograd's O(B L E N) per step.  Exact
  (the same products in the same order as the recurrence, up to summation
  order); a length that is not a multiple of ``chunk`` ends on a short chunk.
* :mod:`prvrlab.models.fused_scan` runs the same recurrence and adjoint on
  CPU in one C++ kernel built on first use (states of 16 channels at a time
  in registers, never a (L, E, N) tensor): about 10x the chunked scan.
* :func:`selective_scan` picks, for ``kernel='auto'``, ``mamba_ssm``'s CUDA
  kernel (``selective_scan_fn``) when that package is importable and the
  tensors are on CUDA, the fused kernel on CPU when it builds, else the
  chunked scan (with one warning saying why); ``'fused'`` and ``'torch'``
  (the chunked scan) force one.

``mask`` (B, L) (True on real steps), where given, zeroes ``delta`` and ``x``
on padded steps: the state then passes through them unchanged.
"""

from __future__ import annotations

import functools
import math
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from prvrlab.checks import check_choice, check_positive_int
from prvrlab.models import fused_scan
from prvrlab.models.blocks import PackedLayer, Packing, decay_norm_gains
from prvrlab.models.layer_norm import LayerNorm

SCAN_KERNELS = ("auto", "fused", "torch")
MAMBA_INITS = ("official", "mamba_ssm")
DEFAULT_SCAN_CHUNK = 32
DEFAULT_BLOCK_ELEMENTS = 1 << 19  # state elements per block of the CPU scan (2 MiB in fp32: stays in cache)
# On a GPU every step of a block is a few kernel launches: blocks of one sequence cost TVR's batch
# (128 videos x 128 frames, E = 768, N = 16) 16,384 steps per scan; blocks of 2^26 elements (256 MiB in
# fp32 per state-sized work tensor) hold the whole batch, 128 steps.
DEVICE_BLOCK_ELEMENTS = 1 << 26


def default_block_elements(device: torch.device) -> int:
    """State elements per block of :func:`selective_scan_chunked` on ``device`` (cache-sized on the CPU)."""
    return DEFAULT_BLOCK_ELEMENTS if device.type == "cpu" else DEVICE_BLOCK_ELEMENTS


def _masked(x: Tensor, delta: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    if mask is None:
        return x, delta
    keep = mask.to(dtype=x.dtype)[..., None]  # (B, L, 1)
    return x * keep, delta * keep


def _skip(y: Tensor, x: Tensor, D: Tensor | None) -> Tensor:
    return y if D is None else y + x * D  # (B, L, E)


def selective_scan_reference(
    x: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None, *, mask: Tensor | None = None
) -> Tensor:
    """The recurrence step by step: (B, L, E) x and delta, (E, N) A, (B, L, N) B and C -> (B, L, E)."""
    x, delta = _masked(x, delta, mask)
    batch, length, channels = x.shape
    h = x.new_zeros(batch, channels, A.shape[1])  # (B, E, N)
    ys = []
    for t in range(length):
        decay = torch.exp(delta[:, t, :, None] * A)  # (B, E, N)
        h = decay * h + (delta[:, t] * x[:, t])[:, :, None] * B[:, t, None, :]  # (B, E, N)
        ys.append((h * C[:, t, None, :]).sum(-1))  # (B, E)
    y = torch.stack(ys, dim=1) if ys else x.new_zeros(batch, 0, channels)  # (B, L, E)
    return _skip(y, x, D)


def _chunk_states(delta: Tensor, u: Tensor, At: Tensor, B: Tensor, h0: Tensor) -> tuple[Tensor, Tensor]:
    """The T states of one chunk from the entering state: (b, T, E) delta and u = delta x, (N, E) At = A^T,
    (b, T, N) B, (b, N, E) h0 -> states and decays, both (T, b, N, E) (channels innermost)."""
    decay = torch.mul(delta.transpose(0, 1)[:, :, None, :], At).exp_()  # (T, b, N, E)
    states = B.transpose(0, 1)[..., None] * u.transpose(0, 1)[:, :, None, :]  # (T, b, N, E) inputs
    states[0].addcmul_(decay[0], h0)
    for j in range(1, states.shape[0]):
        states[j].addcmul_(decay[j], states[j - 1])
    return states, decay


def _blocks(batch: int, length: int, rows: int, chunk: int):
    """(rows slice, chunk index, steps slice) of every block, row blocks outer, chunks in order."""
    for r in range(0, batch, rows):
        for k, t in enumerate(range(0, length, chunk)):
            yield slice(r, r + rows), k, slice(t, t + chunk)


class _ChunkedScan(torch.autograd.Function):
    """The selective scan without the skip (module docstring), forward and backward by hand.

    Forward: per block of ``rows`` sequences and ``chunk`` steps, the chunk's states
    (T, rows, N, E) from the entering state by T in-place steps, then y = C . h as a batched
    matrix product; only the state entering each chunk (K, B, N, E) is kept for the backward.
    Backward, chunks in reverse: recompute the chunk's states and decays, run the adjoint
    recurrence G_t = C_t dy_t + decay_{t+1} G_{t+1} (G_t = dL/dh_t), then
    dC_t = h_t . dy_t, d(delta x)_t = B_t . G_t, dB_t = G_t . (delta x)_t (matrix products) and,
    with W = G_t decay_t h_{t-1} = dL/d(delta_t A), d delta_t += sum_n W A and dA += sum W delta_t.
    Channels are the innermost axis of every state-sized tensor, so every contraction over the
    N = 16 state axis is a vector-matrix product or a sum over an outer axis (fast on CPU).
    """

    @staticmethod
    def forward(ctx, x: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk: int, rows: int) -> Tensor:
        batch, length, channels = x.shape
        At = A.t().contiguous()  # (N, E)
        u = delta * x  # (B, L, E)
        y = x.new_empty(batch, length, channels)
        entering = x.new_empty(math.ceil(length / chunk), batch, A.shape[1], channels)  # (K, B, N, E)
        h = None
        for r, k, t in _blocks(batch, length, rows, chunk):
            if k == 0:
                h = x.new_zeros(entering[0, r].shape)  # (b, N, E)
            entering[k, r] = h
            states, _ = _chunk_states(delta[r, t], u[r, t], At, B[r, t], h)
            y[r, t] = torch.matmul(C[r, t].transpose(0, 1)[:, :, None, :], states)[:, :, 0].transpose(0, 1)  # (b, T, E)
            h = states[-1]
        ctx.save_for_backward(x, delta, A, B, C, entering)
        ctx.blocking = (chunk, rows)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy: Tensor):
        x, delta, A, B, C, entering = ctx.saved_tensors
        chunk, rows = ctx.blocking
        batch, length, _ = x.shape
        At = A.t().contiguous()  # (N, E)
        u = delta * x  # (B, L, E)
        du, ddelta, dB, dC = (torch.empty_like(t) for t in (x, delta, B, C))
        dAt = torch.zeros_like(At)  # (N, E)
        carry = None  # decay_{t+1} G_{t+1} entering the chunk from the one after it: (b, N, E)
        for r, k, t in reversed(list(_blocks(batch, length, rows, chunk))):
            h0 = entering[k, r]  # (b, N, E)
            states, decay = _chunk_states(delta[r, t], u[r, t], At, B[r, t], h0)  # (T, b, N, E) each
            dyt, deltat = dy[r, t].transpose(0, 1), delta[r, t].transpose(0, 1)  # (T, b, E)
            Bt, ut = B[r, t].transpose(0, 1), u[r, t].transpose(0, 1)  # (T, b, N), (T, b, E)
            G = C[r, t].transpose(0, 1)[..., None] * dyt[:, :, None, :]  # (T, b, N, E)
            if carry is not None and t.stop < length:
                G[-1] += carry
            for j in range(G.shape[0] - 2, -1, -1):
                G[j].addcmul_(decay[j + 1], G[j + 1])
            carry = decay[0] * G[0]
            dC[r, t] = torch.matmul(states, dyt[..., None])[..., 0].transpose(0, 1)  # (b, T, N)
            du[r, t] = torch.matmul(Bt[:, :, None, :], G)[:, :, 0].transpose(0, 1)  # (b, T, E)
            dB[r, t] = torch.matmul(G, ut[..., None])[..., 0].transpose(0, 1)  # (b, T, N)
            W = G.mul_(decay)  # (T, b, N, E), times h_{t-1} below: dL/d(delta A)
            W[0].mul_(h0)
            W[1:].mul_(states[:-1])
            ddelta[r, t] = (W * At).sum(2).transpose(0, 1)  # (b, T, E)
            dAt += W.mul_(deltat[:, :, None, :]).sum((0, 1))
        ddelta += du * x
        return du * delta, ddelta, dAt.t(), dB, dC, None, None


def selective_scan_chunked(
    x: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    *,
    mask: Tensor | None = None,
    chunk: int = DEFAULT_SCAN_CHUNK,
    block_elements: int | None = None,
) -> Tensor:
    """The same result as :func:`selective_scan_reference`, computed in blocks of ``chunk`` steps and
    as many sequences as keep a block's states (sequences x chunk x E x N) within ``block_elements``
    (at least one sequence; None: :func:`default_block_elements` of the inputs' device), with a
    hand-written backward (:class:`_ChunkedScan`).  Memory: the inputs, one block's work tensors and
    the states entering each chunk, O(B E N L / chunk)."""
    check_positive_int(chunk, "chunk")
    if block_elements is None:
        block_elements = default_block_elements(x.device)
    check_positive_int(block_elements, "block_elements")
    x, delta = _masked(x, delta, mask)
    batch, length, channels = x.shape
    if length == 0:
        return _skip(x.new_zeros(batch, 0, channels), x, D)
    size = min(chunk, length)
    rows = max(1, block_elements // (size * channels * A.shape[1]))
    return _skip(_ChunkedScan.apply(x, delta, A, B, C, size, rows), x, D)


def _cuda_kernel():
    """``mamba_ssm``'s ``selective_scan_fn``, or None when the package is not importable."""
    try:
        from mamba_ssm.ops.selective_scan_interface import selective_scan_fn
    except ImportError:
        return None
    return selective_scan_fn


@functools.lru_cache(maxsize=None)
def _warn_no_fused(reason: str) -> None:
    warnings.warn(f"the fused CPU selective scan is unavailable ({reason}); using the slower PyTorch chunked scan",
                  RuntimeWarning, stacklevel=3)


def _fused_or_none(x: Tensor, kernel: str):
    """The fused CPU kernel's autograd function for ``kernel`` on ``x``'s device, or None (chunked scan)."""
    if kernel == "torch" or x.device.type != "cpu":
        if kernel == "fused":
            raise ValueError(f"scan kernel 'fused' runs on CPU tensors only, got {x.device}")
        return None
    if fused_scan.load() is not None:
        return fused_scan.FusedScan
    reason = fused_scan.unavailable_reason() or "unknown reason"
    if kernel == "fused":
        raise RuntimeError(f"scan kernel 'fused' could not be built: {reason}")
    _warn_no_fused(reason)
    return None


def selective_scan(
    x: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    *,
    mask: Tensor | None = None,
    chunk: int = DEFAULT_SCAN_CHUNK,
    block_elements: int | None = None,
    kernel: str = "auto",
) -> Tensor:
    """The selective scan in fp32 (autocast off) with ``kernel`` (module docstring): ``auto`` =
    ``mamba_ssm``'s CUDA kernel on CUDA when importable, the fused CPU kernel on CPU when it builds,
    else :func:`selective_scan_chunked`; ``fused`` = the CPU kernel or an error; ``torch`` = chunked."""
    check_choice(kernel, "kernel", SCAN_KERNELS)
    with torch.autocast(device_type=x.device.type, enabled=False):
        x, delta, A, B, C = (t.float() for t in (x, delta, A, B, C))
        D = None if D is None else D.float()
        fn = _cuda_kernel() if kernel == "auto" and x.is_cuda else None
        if fn is None:
            fused = _fused_or_none(x, kernel)
            if fused is None:
                return selective_scan_chunked(x, delta, A, B, C, D, mask=mask, chunk=chunk, block_elements=block_elements)
            xm, dm = _masked(x, delta, mask)
            if xm.shape[1] == 0:
                return _skip(xm.new_zeros(xm.shape), xm, D)
            return _skip(fused.apply(xm, dm, A, B, C, chunk), xm, D)
        x, delta = _masked(x, delta, mask)
        y = fn(
            x.transpose(1, 2).contiguous(),  # (B, E, L)
            delta.transpose(1, 2).contiguous(),
            A.contiguous(),
            B.transpose(1, 2).contiguous(),  # (B, N, L)
            C.transpose(1, 2).contiguous(),
            D,
            delta_softplus=False,
        )
        return y.transpose(1, 2)  # (B, L, E)


class Mamba(nn.Module):
    """The Mamba mixer: (B, L, D) -> (B, L, D).

    ``in_proj`` Linear(D, 2 E) (no bias) -> (x, z) with E = ``expand * D``;
    x -> causal depthwise Conv1d (``d_conv`` taps, with bias) -> SiLU ->
    ``x_proj`` Linear(E, R + 2 N) (no bias) split [dt, B, C] with the rank
    R = ``dt_rank`` (None: ceil(D / 16)); delta = softplus(``dt_proj``(dt)),
    ``dt_proj`` Linear(R, E) whose bias is the delta bias; A = -exp(``A_log``),
    ``A_log`` (E, N) initialised S4D-real (log 1..N in every channel); skip
    ``D`` (E,) initialised to 1; y = scan(x, delta, A, B, C, D) * SiLU(z) ->
    ``out_proj`` Linear(E, D) (no bias).  Linear weights get PyTorch's default
    initialisation here; a backbone re-initialises them (MamFusion's official
    code: N(0, 0.02), zero biases, so delta starts at softplus(0) ~ 0.69), or
    :meth:`init_like_mamba_ssm_` gives the package's own.  ``mask`` (B, L), where
    given, zeroes delta and x on padded steps (:func:`selective_scan`).
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        d_state: int = 16,
        d_conv: int = 4,
        expand: int = 2,
        dt_rank: int | None = None,
        scan_chunk: int = DEFAULT_SCAN_CHUNK,
        scan_kernel: str = "auto",
    ) -> None:
        super().__init__()
        check_positive_int(hidden_size, "hidden_size")
        self.scan_kernel = check_choice(scan_kernel, "scan_kernel", SCAN_KERNELS)
        self.d_state = check_positive_int(d_state, "d_state")
        self.d_conv = check_positive_int(d_conv, "d_conv")
        self.inner = check_positive_int(expand, "expand") * hidden_size
        self.dt_rank = math.ceil(hidden_size / 16) if dt_rank is None else check_positive_int(dt_rank, "dt_rank")
        self.scan_chunk = check_positive_int(scan_chunk, "scan_chunk")
        E, N, R = self.inner, self.d_state, self.dt_rank
        self.in_proj = nn.Linear(hidden_size, 2 * E, bias=False)
        self.conv = nn.Conv1d(E, E, kernel_size=d_conv, groups=E, padding=d_conv - 1)
        self.x_proj = nn.Linear(E, R + 2 * N, bias=False)
        self.dt_proj = nn.Linear(R, E)
        self.A_log = nn.Parameter(torch.empty(E, N, dtype=torch.float32))  # (E, N): log 1..N in every channel (S4D-real)
        with torch.no_grad():  # computed on the CPU: on the meta device torch's arange imports torch._dynamo (~1.3 s)
            self.A_log.copy_(torch.log(torch.arange(1, N + 1, dtype=torch.float32, device="cpu")).expand(E, N))
        self.D = nn.Parameter(torch.ones(E))
        self.out_proj = nn.Linear(E, hidden_size, bias=False)

    @torch.no_grad()
    def init_like_mamba_ssm_(self, *, dt_min: float = 1e-3, dt_max: float = 0.1, dt_floor: float = 1e-4) -> None:
        """``mamba_ssm``'s own initialisation of this mixer (Gu & Dao's): ``in_proj`` / ``x_proj`` /
        ``out_proj`` PyTorch's default, ``dt_proj`` weight U(-R^-1/2, R^-1/2) and its bias the inverse
        softplus of a step drawn log-uniformly from [``dt_min``, ``dt_max``] (at least ``dt_floor``), so
        delta starts there instead of at softplus(0) ~ 0.69; A_log, D and the conv as built."""
        for linear in (self.in_proj, self.x_proj, self.out_proj):
            linear.reset_parameters()
        bound = self.dt_rank ** -0.5
        nn.init.uniform_(self.dt_proj.weight, -bound, bound)
        lo, hi = math.log(dt_min), math.log(dt_max)
        u = torch.rand(self.inner, device=self.dt_proj.bias.device)  # (E,)
        dt = torch.exp(u * (hi - lo) + lo).clamp_(min=dt_floor)  # (E,)
        self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus(bias) = dt

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """(B, L, D) with an optional (B, L) mask -> (B, L, D)."""
        length = x.shape[1]
        xs, z = self.in_proj(x).chunk(2, dim=-1)  # (B, L, E) each
        xs = self.conv(xs.transpose(1, 2))[..., :length].transpose(1, 2)  # causal: (B, L, E)
        xs = F.silu(xs)
        dt, B, C = self.x_proj(xs).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        # as mamba_ssm: the product (under autocast in its precision), then the bias and softplus in fp32 (its
        # kernel's delta_bias): a bf16 sum would round mamba_ssm's initial bias, ~-6.9, to steps of 0.03
        delta = F.softplus(F.linear(dt, self.dt_proj.weight).float() + self.dt_proj.bias.float())  # (B, L, E) fp32
        A = -torch.exp(self.A_log.float())  # (E, N)
        y = selective_scan(xs, delta, A, B, C, self.D, mask=mask, chunk=self.scan_chunk, kernel=self.scan_kernel)  # (B, L, E) fp32
        return self.out_proj((y * F.silu(z.float())).to(z.dtype))  # (B, L, D)


class MambaLayer(PackedLayer):
    """``x + LayerNorm(Mamba(x))`` on packed tokens, as MamFusion's reference code after every GMMBlock.

    The mixer runs on the padded layout (zeros on padding).  ``mask_padding``:
    False (the reference) scans padded steps like real ones; True zeroes delta
    and x there.  Both give the same real tokens: the conv and the scan are
    causal and padding trails the real tokens.  ``zero_init``: the LayerNorm's
    scale starts at 0 instead of 1, so the layer starts as the identity and
    learns how much of the mixer to add (the reference adds a unit-variance
    term of the untrained mixer from the first step).  ``decay_norm_gain``: the
    LayerNorm's gain is weight-decayed (``decayed_parameters``), as the
    reference's name-based grouping does for this LayerNorm alone.  ``bare``: the mixer's output
    alone, no residual and no LayerNorm (the paper's Eq. 5, ``V_fm = Mamba(V_fg)``).
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        d_state: int = 16,
        d_conv: int = 4,
        expand: int = 2,
        mask_padding: bool = False,
        zero_init: bool = False,
        bare: bool = False,
        decay_norm_gain: bool = False,
        scan_chunk: int = DEFAULT_SCAN_CHUNK,
        scan_kernel: str = "auto",
    ) -> None:
        super().__init__()
        if zero_init and bare:
            raise ValueError("zero_init and bare exclude each other: a bare layer has no LayerNorm to start at 0")
        self.mamba = Mamba(hidden_size=hidden_size, d_state=d_state, d_conv=d_conv, expand=expand, scan_chunk=scan_chunk,
                           scan_kernel=scan_kernel)
        self.norm = None if bare else LayerNorm(hidden_size)
        if zero_init:
            nn.init.zeros_(self.norm.weight)
        if self.norm is not None:
            decay_norm_gains(self.norm, decay_norm_gain)
        self.mask_padding = bool(mask_padding)

    def forward_packed(self, x: Tensor, packing: Packing) -> Tensor:
        """(N, D) packed tokens -> (N, D)."""
        mask = packing.key_mask if self.mask_padding else None
        mixed = packing.pack(self.mamba(packing.unpack(x), mask))  # (N, D)
        return mixed if self.norm is None else x + self.norm(mixed)
