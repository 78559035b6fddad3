"""Random bits for CPU dropout masks, fast: ``random_bits.cpp`` built on first use, called through ctypes.

A dropout draw (:func:`prvrlab.models.blocks.dropout_draw`) needs two random
bytes per element: 134 MB for one attention layer of GMMFormer v2 at batch
128.  torch's CPU generator (mt19937) makes them one 64-bit word at a time;
the kernel writes the SplitMix64 sequence of one seed, vectorised over
threads (its source says why the sequence is a sound generator).  The seed
is one draw of torch's default CPU generator, so ``torch.manual_seed``
reproduces every mask, and runs that draw in the same order get the same
masks whichever path computes with them.  :func:`random_mask` writes the
dropout mask itself from the same words in one pass (the draw, a comparison
and a select cost 3-4x more: 67 against ~20 ms for (8, 9786, 384) in bf16).
A :class:`DeferredDraw` is a draw not written at all (its seed and which
elements): :func:`apply_mask_` multiplies its mask into a tensor in place,
element by element, where the mask would be written and read again,
:func:`masked` into a new tensor, and :func:`residual_masked` adds a tensor
times it to another (a residual connection's dropout).

Build: :mod:`prvrlab.models.native`; without it, torch's generator fills
the words (:func:`unavailable_reason` says why).  Threads:
``torch.get_num_threads()`` ranges of words (the words do not depend on it).
"""

from __future__ import annotations

import ctypes
import math
from pathlib import Path

import torch
from torch import Tensor

from prvrlab.models import native

SOURCE = Path(__file__).with_name("random_bits.cpp")
ABI = 5  # prvrlab_random_abi() of a library this module can call


def _declare(lib: ctypes.CDLL) -> None:
    lib.prvrlab_random_fill.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64, ctypes.c_int]
    lib.prvrlab_random_fill.restype = None
    run = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    lib.prvrlab_dropout_mask.argtypes = run + [ctypes.c_uint32, ctypes.c_int]
    lib.prvrlab_dropout_mask.restype = None
    lib.prvrlab_dropout_apply.argtypes = run + [ctypes.c_float, ctypes.c_int]
    lib.prvrlab_dropout_apply.restype = None
    lib.prvrlab_dropout_apply_to.argtypes = [ctypes.c_void_p] + run + [ctypes.c_float, ctypes.c_int]
    lib.prvrlab_dropout_apply_to.restype = None
    lib.prvrlab_dropout_residual.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_int64] + run[2:] + [ctypes.c_float]
    lib.prvrlab_dropout_residual.restype = None


# load(): the built library (built on first use) or None; unavailable_reason(): why None
load, unavailable_reason = native.loader(SOURCE, abi_symbol="prvrlab_random_abi", abi=ABI, declare=_declare)


def random_words(n: int) -> Tensor:
    """(n,) int64 CPU tensor of uniformly random 64-bit words (module docstring)."""
    out = torch.empty(n, dtype=torch.int64, device="cpu")
    lib = load()
    if lib is None:
        return out.random_(-(2**63), None)
    lib.prvrlab_random_fill(out.data_ptr(), n, _seed(), torch.get_num_threads())
    return out


def _seed() -> int:
    """One draw of torch's default CPU generator: the seed of a sequence of words."""
    return int(torch.empty((), dtype=torch.int64, device="cpu").random_())


def random_mask(shape: tuple[int, ...], threshold: int, scale: Tensor, draw: "DeferredDraw | None" = None) -> Tensor | None:
    """A CPU tensor of ``shape`` and ``scale``'s dtype (2 or 4 bytes an element): ``scale`` where the int16 view
    of :func:`random_words` ``((n + 3) // 4)`` (same seed draw) is at least ``threshold`` (in [-32768, 32767]),
    else 0; None without the kernel (nothing drawn).  With ``draw``: the mask of that deferred draw (its seed,
    its elements), no new draw."""
    _check_threshold(threshold)
    if draw is not None and tuple(shape) != draw.shape:
        raise ValueError(f"a mask of shape {tuple(shape)} asked of a deferred draw of shape {draw.shape}")
    lib = load()
    if lib is None or scale.element_size() not in (2, 4):
        return None
    out = torch.empty(shape, dtype=scale.dtype, device="cpu")
    seed, offset = (_seed(), 0) if draw is None else (draw.seed, draw.offset)
    bits = int(scale.view(torch.int16 if scale.element_size() == 2 else torch.int32)) & 0xFFFFFFFF
    lib.prvrlab_dropout_mask(
        out.data_ptr(), out.numel(), seed, offset, torch.get_num_threads(), threshold, bits, scale.element_size()
    )
    return out


def _check_threshold(threshold: int) -> None:
    if not -32768 <= threshold <= 32767:
        raise ValueError(f"a dropout threshold is an int16 value, got {threshold} (none kept: no mask to draw)")


class DeferredDraw:
    """A dropout draw not written anywhere: the seed of its words (one draw of the default generator, taken
    when it is made, as :func:`random_mask` takes it) and the element ``offset`` and ``shape`` of this view
    of it.  Indexing the first dimension (an integer or a step-1 slice) gives the view of those rows, whose
    mask is that slice of the whole mask.  Its mask is made on demand (:func:`random_mask`) or multiplied
    into a tensor without ever being written (:func:`apply_mask_`)."""

    def __init__(self, shape: tuple[int, ...], seed: int | None = None, offset: int = 0) -> None:
        self.shape = tuple(int(n) for n in shape)
        self.seed = _seed() if seed is None else int(seed)
        self.offset = int(offset)

    def __getitem__(self, index: int | slice) -> "DeferredDraw":
        rows, inner = self.shape[0], math.prod(self.shape[1:])
        if isinstance(index, slice):
            start, stop, step = index.indices(rows)
            if step != 1:
                raise IndexError("a deferred draw takes step-1 slices of its first dimension")
            return DeferredDraw((max(0, stop - start), *self.shape[1:]), self.seed, self.offset + start * inner)
        if isinstance(index, bool) or not hasattr(index, "__index__"):  # a bool is an int, but indexes otherwise
            raise IndexError(f"a deferred draw takes an integer or a step-1 slice, got {index!r}")
        index = index.__index__()
        k = index + rows if index < 0 else index
        if not 0 <= k < rows:
            raise IndexError(f"index {index} out of range for {rows} rows")
        return DeferredDraw(self.shape[1:], self.seed, self.offset + k * inner)

    def __repr__(self) -> str:
        return f"DeferredDraw(shape={self.shape}, offset={self.offset})"


def _applying_library(x: Tensor, draw: DeferredDraw, threshold: int) -> ctypes.CDLL | None:
    """The kernel library where it can apply ``draw``'s mask to ``x`` (a contiguous bf16 / float32 CPU tensor),
    else None; ValueError for a threshold outside int16 or an ``x`` not of the draw's shape."""
    _check_threshold(threshold)
    if tuple(x.shape) != draw.shape:
        raise ValueError(f"a tensor of shape {tuple(x.shape)} given the mask of a draw of shape {draw.shape}")
    lib = load()
    if lib is None or x.device.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float32) or not x.is_contiguous():
        return None
    return lib


def masked(x: Tensor, draw: DeferredDraw, threshold: int, scale: float) -> Tensor | None:
    """``x * mask`` for the mask of ``draw`` (as :func:`apply_mask_`) into a new tensor, in one pass that reads
    ``x`` and writes the result (the mask is never written); None where the kernel cannot (no kernel, not a
    contiguous bf16 / float32 CPU tensor).  No autograd: the caller records it (``x`` must have the draw's
    shape)."""
    lib = _applying_library(x, draw, threshold)
    if lib is None:
        return None
    out = torch.empty_like(x)
    lib.prvrlab_dropout_apply_to(x.data_ptr(), out.data_ptr(), x.numel(), draw.seed, draw.offset,
                                 torch.get_num_threads(), threshold, scale, x.element_size())
    return out


def _residual_library(x: Tensor, a: Tensor, draw: DeferredDraw, threshold: int) -> ctypes.CDLL | None:
    """The kernel library where :func:`residual_masked` can compute (its docstring), else None."""
    lib = _applying_library(a, draw, threshold)
    fits = (a.dtype == torch.bfloat16 and x.dtype == a.dtype and x.device == a.device and x.is_contiguous()
            and tuple(x.shape) in (tuple(a.shape), tuple(a.shape[1:])))
    return lib if fits else None


def residual_takes(x: Tensor, a: Tensor, draw: DeferredDraw, threshold: int) -> bool:
    """Whether :func:`residual_masked` computes for these tensors (rather than returning None)."""
    return _residual_library(x, a, draw, threshold) is not None


def residual_masked(x: Tensor, a: Tensor, draw: DeferredDraw, threshold: int, scale: float) -> Tensor | None:
    """``torch.addcmul(x, a, mask)`` for the mask of ``draw`` (``a``'s shape; ``x`` of ``a``'s shape or of its
    trailing dimensions, broadcast over the first) into a new tensor, in one pass that never writes the mask: the
    same values, a * scale being exact in float for bfloat16.  None where the kernel cannot (no kernel, ``x`` and
    ``a`` not contiguous bfloat16 CPU tensors, another shape of ``x``).  No autograd: the caller records it."""
    lib = _residual_library(x, a, draw, threshold)
    if lib is None:
        return None
    out = torch.empty_like(a)
    lib.prvrlab_dropout_residual(x.data_ptr(), a.data_ptr(), out.data_ptr(), a.numel(), max(1, x.numel()), draw.seed,
                                 draw.offset, torch.get_num_threads(), threshold, scale)
    return out


def apply_mask_(x: Tensor, draw: DeferredDraw, threshold: int, scale: float) -> bool:
    """``x.mul_(mask)`` for the mask of ``draw`` (kept elements ``scale``, the dropout multiplier as ``x``'s
    dtype rounds it), computed element by element and never written: True when done, False (``x`` untouched)
    where the kernel cannot (no kernel, not a contiguous bf16 / float32 CPU tensor, a tensor autograd records:
    the kernel's write is invisible to it, an inference tensor outside inference mode, which ``mul_``
    refuses).  ``x`` must have the draw's shape."""
    lib = _applying_library(x, draw, threshold)
    if lib is None or (x.requires_grad and torch.is_grad_enabled()) or (x.is_inference() and not torch.is_inference_mode_enabled()):
        return False
    lib.prvrlab_dropout_apply(
        x.data_ptr(), x.numel(), draw.seed, draw.offset, torch.get_num_threads(), threshold, scale, x.element_size()
    )
    torch.autograd.graph.increment_version(x)  # an in-place write, as mul_ would count it for saved tensors
    return True
