"""Generic building blocks shared by the backbones.

Sequences are either *padded* ``(B, L, D)`` with a ``(B, L)`` mask (True on
real tokens, real tokens first) or *packed* ``(N, D)``: only the N real
tokens, described by a :class:`Packing`.  Token-wise layers (projections,
feed-forward networks, normalisation) run on packed tokens so that no compute
is spent on padding; only attention needs the padded layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def check_positive_int(value: object, name: str) -> int:
    """``value`` as an int > 0, else a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def check_probability(value: object, name: str) -> float:
    """``value`` as a float in [0, 1), else a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be a number in [0, 1), got {value!r}")
    return float(value)


def dropout_mask(x: Tensor, p: float) -> Tensor:
    """The inverted-dropout multiplier of ``x``: 0 with probability ``p``, else 1/(1-p) (x's shape and dtype).

    On CPU the mask is drawn from 16-bit random integers, four per 64-bit draw
    of the global torch RNG (drop probability rounded to 1/65536):
    ``torch.nn.functional.dropout`` draws one Bernoulli variate per element,
    which dominates the cost of dropout on CPU.
    """
    if x.device.type != "cpu":
        return torch.empty_like(x).bernoulli_(1.0 - p).div_(1.0 - p)
    n = x.numel()
    bits = torch.empty((n + 3) // 4, dtype=torch.int64).random_(-(2**63), None)
    bits = bits.view(torch.int16)[:n].view(x.shape)  # uniform over [-32768, 32767]
    threshold = -32768 + round(p * 65536)
    scale = torch.tensor(1.0 / (1.0 - p), dtype=x.dtype)
    return torch.where(bits >= threshold, scale, torch.zeros((), dtype=x.dtype))


def fast_dropout(x: Tensor, p: float, training: bool) -> Tensor:
    """Inverted dropout with :func:`dropout_mask` on CPU, ``F.dropout`` elsewhere."""
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu":
        return F.dropout(x, p, training=True)
    return x * dropout_mask(x, p)


class Dropout(nn.Module):
    """Drop-in ``nn.Dropout`` using :func:`fast_dropout` (a cheaper mask on CPU)."""

    def __init__(self, p: float = 0.1, *, name: str = "dropout") -> None:
        super().__init__()
        self.p = check_probability(p, name)

    def forward(self, x: Tensor) -> Tensor:
        return fast_dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"


def autocast_input(x: Tensor) -> Tensor:
    """``x`` cast to the autocast dtype when autocast is on for its device (else unchanged)."""
    device = x.device.type
    if x.is_floating_point() and torch.is_autocast_enabled(device):
        return x.to(torch.get_autocast_dtype(device))
    return x


class BranchLinear(nn.Module):
    """K independent Linear(in_dim, out_dim) maps applied as one batched GEMM.

    ``weight`` (K, out_dim, in_dim), ``bias`` (K, out_dim); input (K, N, in_dim)
    -> output (K, N, out_dim), branch k using ``weight[k]``.
    """

    def __init__(self, *, num_branches: int, in_dim: int, out_dim: int) -> None:
        super().__init__()
        shape = (
            check_positive_int(num_branches, "num_branches"),
            check_positive_int(out_dim, "out_dim"),
            check_positive_int(in_dim, "in_dim"),
        )
        self.weight = nn.Parameter(torch.empty(shape))
        self.bias = nn.Parameter(torch.zeros(num_branches, out_dim))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: Tensor) -> Tensor:
        """(K, N, in_dim) -> (K, N, out_dim)."""
        return torch.baddbmm(self.bias[:, None, :], x, self.weight.transpose(1, 2))


def branch_layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-5) -> Tensor:
    """LayerNorm over the last dim of (K, N, D) with a per-branch affine ``weight``/``bias`` (K, D)."""
    y = F.layer_norm(x, (x.shape[-1],), eps=eps)  # (K, N, D)
    return torch.addcmul(bias[:, None, :], y, weight[:, None, :])  # (K, N, D)


def init_normal_(module: nn.Module, std: float = 0.02) -> None:
    """Initialise Linear/BranchLinear/Embedding weights from N(0, std) and biases to zero."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding, BranchLinear)):
            nn.init.normal_(m.weight, mean=0.0, std=std)
        if isinstance(m, (nn.Linear, BranchLinear)) and m.bias is not None:
            nn.init.zeros_(m.bias)


@dataclass(frozen=True)
class Packing:
    """Where the real tokens of a padded ``(B, L)`` batch are.

    ``lengths`` (B,) real tokens per row; ``positions`` (N,) position of each
    real token in its row; ``index`` (N,) flat index ``b * L + t`` of each real
    token, or None when nothing is padded (packing is then a free reshape).
    """

    batch: int
    length: int
    lengths: Tensor
    positions: Tensor
    index: Tensor | None
    mask: Tensor

    @staticmethod
    def full(batch: int, length: int, device: torch.device | str) -> "Packing":
        """The packing of a batch without padding."""
        lengths = torch.full((batch,), length, dtype=torch.long, device=device)
        positions = torch.arange(length, device=device).repeat(batch)  # (B*L,)
        mask = torch.ones(batch, length, dtype=torch.bool, device=device)
        return Packing(batch, length, lengths, positions, None, mask)

    @staticmethod
    def from_mask(mask: Tensor | None, batch: int, length: int, device: torch.device | str) -> "Packing":
        """The packing of a ``(B, L)`` prefix mask (None: no padding)."""
        if mask is None:
            return Packing.full(batch, length, device)
        if mask.shape != (batch, length):
            raise ValueError(f"mask has shape {tuple(mask.shape)}, expected {(batch, length)}")
        mask = mask.to(device=device, dtype=torch.bool)
        lengths = mask.sum(dim=1)  # (B,)
        steps = torch.arange(length, device=device)
        if not torch.equal(mask, steps[None, :] < lengths[:, None]):
            raise ValueError("masks must put real tokens first (True...True False...False per row)")
        if bool((lengths == length).all()):
            return Packing.full(batch, length, device)
        index = mask.reshape(-1).nonzero().squeeze(1)  # (N,)
        return Packing(batch, length, lengths, index % length, index, mask)

    @property
    def is_full(self) -> bool:
        return self.index is None

    @property
    def num_tokens(self) -> int:
        return self.batch * self.length if self.index is None else int(self.index.shape[0])

    def rows(self) -> Tensor:
        """(N,) long: the batch row of every packed token."""
        device = self.positions.device
        if self.index is None:
            return torch.arange(self.batch, device=device).repeat_interleave(self.length)  # (B*L,)
        return torch.div(self.index, self.length, rounding_mode="floor")  # (N,)

    def pack(self, x: Tensor) -> Tensor:
        """(B, L, *F) -> (N, *F), keeping only real tokens."""
        flat = x.reshape(self.batch * self.length, *x.shape[2:])  # (B*L, *F)
        return flat if self.index is None else flat.index_select(0, self.index)

    def unpack(self, x: Tensor) -> Tensor:
        """(N, *F) -> (B, L, *F), zeros on padding."""
        if self.index is None:
            return x.reshape(self.batch, self.length, *x.shape[1:])
        out = x.new_zeros(self.batch * self.length, *x.shape[1:])  # (B*L, *F)
        out = out.index_copy(0, self.index, x)
        return out.reshape(self.batch, self.length, *x.shape[1:])


class InputProjection(nn.Module):
    """LayerNorm -> Dropout -> Linear -> ReLU, applied token-wise on (..., in_dim)."""

    def __init__(self, *, in_dim: int, out_dim: int, dropout: float = 0.1) -> None:
        super().__init__()
        check_positive_int(in_dim, "in_dim")
        check_positive_int(out_dim, "out_dim")
        self.norm = nn.LayerNorm(in_dim)
        self.dropout = Dropout(dropout)
        self.linear = nn.Linear(in_dim, out_dim)

    def forward(self, x: Tensor) -> Tensor:
        """(..., in_dim) -> (..., out_dim); under autocast the wide input is cast first."""
        return F.relu(self.linear(self.dropout(self.norm(autocast_input(x)))))


class PositionalEmbedding(nn.Module):
    """Learned positional embedding added to the tokens, then LayerNorm and Dropout."""

    def __init__(self, *, max_len: int, hidden_size: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.max_len = check_positive_int(max_len, "max_len")
        self.embedding = nn.Embedding(max_len, check_positive_int(hidden_size, "hidden_size"))
        self.norm = nn.LayerNorm(hidden_size)
        self.dropout = Dropout(dropout)

    def _check(self, length: int) -> None:
        if length > self.max_len:
            raise ValueError(f"sequence length {length} exceeds the positional embedding's max_len={self.max_len}")

    def forward(self, x: Tensor) -> Tensor:
        """(B, L, D) -> (B, L, D)."""
        self._check(x.shape[1])
        pos = self.embedding.weight[: x.shape[1]]  # (L, D)
        return self.dropout(self.norm(x + pos))

    def forward_packed(self, x: Tensor, packing: Packing) -> Tensor:
        """(N, D) packed tokens -> (N, D)."""
        self._check(packing.length)
        if packing.is_full:  # broadcast add: a cheap backward (sum over the batch)
            pos = self.embedding.weight[: packing.length]  # (L, D)
            x = (x.view(packing.batch, packing.length, -1) + pos).view(packing.num_tokens, -1)
        else:
            x = x + self.embedding(packing.positions)  # (N, D)
        return self.dropout(self.norm(x))


class AttentionPooling(nn.Module):
    """Pool a sequence to one vector: Linear(d, 1) scores, masked softmax, weighted sum.

    The score layer has no bias (a softmax ignores it).  A row without any
    real token pools to the zero vector.
    """

    def __init__(self, *, hidden_size: int) -> None:
        super().__init__()
        self.score = nn.Linear(check_positive_int(hidden_size, "hidden_size"), 1, bias=False)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """(B, L, D) with (B, L) mask -> (B, D)."""
        logits = self.score(x).squeeze(-1).float()  # (B, L)
        return self._pool(x, logits, mask)

    def forward_packed(self, x: Tensor, packing: Packing) -> Tensor:
        """(N, D) packed tokens -> (B, D)."""
        logits = packing.unpack(self.score(x).squeeze(-1).float())  # (B, L)
        padded = packing.unpack(x)  # (B, L, D)
        return self._pool(padded, logits, None if packing.is_full else packing.mask)

    @staticmethod
    def _pool(x: Tensor, logits: Tensor, mask: Tensor | None) -> Tensor:
        if mask is not None:
            logits = logits.masked_fill(~mask, torch.finfo(logits.dtype).min)
        weights = torch.softmax(logits, dim=-1)  # (B, L)
        if mask is not None:
            weights = weights * mask  # fully padded rows pool to zero
        return torch.einsum("bl,bld->bd", weights.to(x.dtype), x)  # (B, D)



class AdditiveAttentionPooling(AttentionPooling):
    """Additive (Bahdanau) attention pooling: scores ``v^T tanh(W x + b)``, masked softmax, weighted sum.

    ``attention_size`` is the width of ``W`` (default: ``hidden_size``).  The
    same masking rules as :class:`AttentionPooling` (a row without real
    tokens pools to zero).
    """

    def __init__(self, *, hidden_size: int, attention_size: int | None = None) -> None:
        super().__init__(hidden_size=hidden_size)
        width = hidden_size if attention_size is None else check_positive_int(attention_size, "attention_size")
        self.project = nn.Linear(hidden_size, width)
        self.score = nn.Linear(width, 1, bias=False)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """(B, L, D) with (B, L) mask -> (B, D)."""
        logits = self.score(torch.tanh(self.project(x))).squeeze(-1).float()  # (B, L)
        return self._pool(x, logits, mask)

    def forward_packed(self, x: Tensor, packing: Packing) -> Tensor:
        """(N, D) packed tokens -> (B, D)."""
        logits = packing.unpack(self.score(torch.tanh(self.project(x))).squeeze(-1).float())  # (B, L)
        return self._pool(packing.unpack(x), logits, None if packing.is_full else packing.mask)


def check_backbone_sizes(
    *, video_dim: int, query_dim: int, hidden_size: int, num_heads: int, dropout: float, attention_dropout: float
) -> None:
    """The checks every backbone constructor shares; a ValueError names the bad parameter."""
    check_positive_int(video_dim, "video_dim")
    check_positive_int(query_dim, "query_dim")
    check_positive_int(hidden_size, "hidden_size")
    check_positive_int(num_heads, "num_heads")
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size={hidden_size} must be divisible by num_heads={num_heads}")
    check_probability(dropout, "dropout")
    check_probability(attention_dropout, "attention_dropout")
