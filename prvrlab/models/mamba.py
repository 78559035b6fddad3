"""Mamba (Gu & Dao, 2023): the selective scan and the Mamba mixer block, in plain PyTorch.

The selective state-space recurrence over a sequence of length L, per channel
e (E channels) with an N-dimensional state::

    h_t = exp(delta_t,e A_e) * h_{t-1} + delta_t,e x_t,e B_t      (N,)
    y_t,e = <C_t, h_t> + D_e x_t,e

with ``x``, ``delta`` (B, L, E), ``A`` (E, N) (negative), input-dependent
``B``, ``C`` (B, L, N) and the skip ``D`` (E,).

* :func:`selective_scan_reference` runs it step by step (the definition; tests).
* :func:`selective_scan_chunked` splits L into K chunks of length C and runs
  (1) the recurrence inside every chunk from a zero state, all K chunks at once
  (C vectorised steps), (2) a short recurrence across chunks that carries each
  chunk's final state into the next (K steps), (3) one vectorised correction
  ``h_t += (prod of the chunk's decays up to t) * carried state``, the decays
  being ``exp`` of a cumulative sum of ``delta A`` inside the chunk (always
  <= 0, so nothing overflows).  About ``C + L / C`` Python steps instead of L,
  every product of decays is <= 1 (stable in fp32), and autograd gives the
  gradient.  A length that is not a multiple of C is padded at the end with
  ``delta = 0`` (decay 1, no input), which cannot reach earlier steps.
  Its memory is O(B L E N); :func:`selective_scan_blocked` runs it on blocks
  of batch rows and channels, checkpointed, to bound that.
* :func:`selective_scan` picks ``mamba_ssm``'s CUDA kernel
  (``selective_scan_fn``) when that package is importable and the tensors are
  on CUDA, else the chunked scan.

``mask`` (B, L) (True on real steps), where given, zeroes ``delta`` and ``x``
on padded steps: the state then passes through them unchanged.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn

from prvrlab.checks import check_positive_int
from prvrlab.models.blocks import PackedLayer, Packing

DEFAULT_SCAN_CHUNK = 16
DEFAULT_BLOCK_ELEMENTS = 1 << 25  # 32 M state elements (128 MiB in fp32) per block of the CPU scan


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


def _to_chunks(t: Tensor, num_chunks: int, chunk: int) -> Tensor:
    """(B, K*C, F) -> (B, C, K, F): position j of every chunk side by side."""
    return t.view(t.shape[0], num_chunks, chunk, t.shape[-1]).transpose(1, 2)


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
) -> Tensor:
    """The same result as :func:`selective_scan_reference` in about ``chunk + L / chunk`` vectorised steps
    (module docstring); memory O(B L E N)."""
    check_positive_int(chunk, "chunk")
    x, delta = _masked(x, delta, mask)
    batch, length, channels = x.shape
    if length == 0:
        return _skip(x.new_zeros(batch, 0, channels), x, D)
    size = min(chunk, length)
    num_chunks = math.ceil(length / size)
    pad = num_chunks * size - length
    xs, ds, bs, cs = (F.pad(t, (0, 0, 0, pad)) if pad else t for t in (x, delta, B, C))  # (B, K*C, .)
    xs, ds, bs, cs = (_to_chunks(t, num_chunks, size) for t in (xs, ds, bs, cs))  # (B, C, K, .)
    inputs = ((ds * xs)[..., None] * bs[:, :, :, None, :]).unbind(1)  # C x (B, K, E, N)
    decay = torch.exp(ds[..., None] * A).unbind(1)  # C x (B, K, E, N)
    h = inputs[0]
    local = [h]
    for j in range(1, size):  # inside every chunk, from a zero state
        h = torch.addcmul(inputs[j], decay[j], h)
        local.append(h)
    within = torch.exp(torch.cumsum(ds, dim=1)[..., None] * A)  # (B, C, K, E, N) decay from the chunk start to j
    ends, totals = h.unbind(1), within[:, -1].unbind(1)  # K x (B, E, N) each
    carry = x.new_zeros(batch, channels, A.shape[1])  # (B, E, N)
    carried = []
    for k in range(num_chunks):  # across chunks: the state entering chunk k
        carried.append(carry)
        carry = torch.addcmul(ends[k], totals[k], carry)
    states = torch.addcmul(torch.stack(local, dim=1), within, torch.stack(carried, dim=1)[:, None])  # (B, C, K, E, N)
    y = torch.einsum("bcken,bckn->bcke", states, cs)  # (B, C, K, E)
    y = y.transpose(1, 2).reshape(batch, num_chunks * size, channels)[:, :length]  # (B, L, E)
    return _skip(y, x, D)


def selective_scan_blocked(
    x: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    *,
    mask: Tensor | None = None,
    chunk: int = DEFAULT_SCAN_CHUNK,
    max_elements: int = DEFAULT_BLOCK_ELEMENTS,
) -> Tensor:
    """:func:`selective_scan_chunked` over blocks of batch rows and channels (the channels are
    independent) with at most ``max_elements`` state elements (rows x L x channels x N) each; with
    gradients on, every block is checkpointed, so memory stays bounded by one block's intermediates
    plus the inputs (the backward recomputes the block's forward)."""
    check_positive_int(max_elements, "max_elements")
    x, delta = _masked(x, delta, mask)
    batch, length, channels = x.shape
    state = A.shape[1]
    per_row = max(1, length * state)
    rows = batch if batch * channels * per_row <= max_elements else max(1, max_elements // (per_row * channels))
    width = min(channels, max(1, max_elements // (rows * per_row)))
    if rows >= batch and width >= channels:
        return selective_scan_chunked(x, delta, A, B, C, D, chunk=chunk)
    checkpointed = torch.is_grad_enabled() and any(t.requires_grad for t in (x, delta, A, B, C))

    def block(*args: Tensor) -> Tensor:
        return selective_scan_chunked(*args, chunk=chunk)

    out_rows = []
    for r in range(0, batch, rows):
        parts = []
        for c in range(0, channels, width):
            cs = slice(c, c + width)
            args = (x[r : r + rows, :, cs], delta[r : r + rows, :, cs], A[cs], B[r : r + rows], C[r : r + rows])
            args = args + (() if D is None else (D[cs],))
            if checkpointed:
                parts.append(torch.utils.checkpoint.checkpoint(block, *args, use_reentrant=False))
            else:
                parts.append(block(*args))
        out_rows.append(torch.cat(parts, dim=-1))  # (rows, L, E)
    return torch.cat(out_rows, dim=0)  # (B, L, E)


def _cuda_kernel():
    """``mamba_ssm``'s ``selective_scan_fn``, or None when the package is not importable."""
    try:
        from mamba_ssm.ops.selective_scan_interface import selective_scan_fn
    except ImportError:
        return None
    return selective_scan_fn


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
    max_elements: int = DEFAULT_BLOCK_ELEMENTS,
    kernel: str = "auto",
) -> Tensor:
    """The selective scan in fp32 (autocast off): ``mamba_ssm``'s CUDA kernel when ``kernel`` is ``auto``
    and it is importable on a CUDA tensor, else :func:`selective_scan_blocked` (``kernel='torch'``)."""
    if kernel not in ("auto", "torch"):
        raise ValueError(f"kernel must be 'auto' or 'torch', got {kernel!r}")
    with torch.autocast(device_type=x.device.type, enabled=False):
        x, delta, A, B, C = (t.float() for t in (x, delta, A, B, C))
        D = None if D is None else D.float()
        fn = _cuda_kernel() if kernel == "auto" and x.is_cuda else None
        if fn is None:
            return selective_scan_blocked(x, delta, A, B, C, D, mask=mask, chunk=chunk, max_elements=max_elements)
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
    initialisation here; a backbone re-initialises them (MamFusion: N(0, 0.02),
    zero biases, so delta starts at softplus(0)).  ``mask`` (B, L), where
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
    ) -> None:
        super().__init__()
        check_positive_int(hidden_size, "hidden_size")
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
        self.A_log = nn.Parameter(torch.log(torch.arange(1, N + 1, dtype=torch.float32)).repeat(E, 1))  # (E, N)
        self.D = nn.Parameter(torch.ones(E))
        self.out_proj = nn.Linear(E, hidden_size, bias=False)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """(B, L, D) with an optional (B, L) mask -> (B, L, D)."""
        length = x.shape[1]
        xs, z = self.in_proj(x).chunk(2, dim=-1)  # (B, L, E) each
        xs = self.conv(xs.transpose(1, 2))[..., :length].transpose(1, 2)  # causal: (B, L, E)
        xs = F.silu(xs)
        dt, B, C = self.x_proj(xs).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        delta = F.softplus(self.dt_proj(dt))  # (B, L, E)
        A = -torch.exp(self.A_log.float())  # (E, N)
        y = selective_scan(xs, delta, A, B, C, self.D, mask=mask, chunk=self.scan_chunk)  # (B, L, E) fp32
        return self.out_proj((y * F.silu(z.float())).to(z.dtype))  # (B, L, D)


class MambaLayer(PackedLayer):
    """``x + LayerNorm(Mamba(x))`` on packed tokens, as MamFusion's reference code after every GMMBlock.

    The mixer runs on the padded layout (zeros on padding).  ``mask_padding``:
    False (the reference) scans padded steps like real ones; True zeroes delta
    and x there.  Both give the same real tokens: the conv and the scan are
    causal and padding trails the real tokens.
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        d_state: int = 16,
        d_conv: int = 4,
        expand: int = 2,
        mask_padding: bool = False,
        scan_chunk: int = DEFAULT_SCAN_CHUNK,
    ) -> None:
        super().__init__()
        self.mamba = Mamba(hidden_size=hidden_size, d_state=d_state, d_conv=d_conv, expand=expand, scan_chunk=scan_chunk)
        self.norm = nn.LayerNorm(hidden_size)
        self.mask_padding = bool(mask_padding)

    def forward_packed(self, x: Tensor, packing: Packing) -> Tensor:
        """(N, D) packed tokens -> (N, D)."""
        mask = packing.mask if self.mask_padding and not packing.is_full else None
        mixed = self.mamba(packing.unpack(x), mask)  # (B, L, D)
        return x + self.norm(packing.pack(mixed))  # (N, D)
