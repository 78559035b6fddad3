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

Build: :mod:`prvrlab.models.native`; without it, torch's generator fills
the words (:func:`unavailable_reason` says why).  Threads:
``torch.get_num_threads()`` ranges of words (the words do not depend on it).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import Tensor

from prvrlab.models import native

SOURCE = Path(__file__).with_name("random_bits.cpp")
ABI = 2  # prvrlab_random_abi() of a library this module can call


def _declare(lib: ctypes.CDLL) -> None:
    lib.prvrlab_random_fill.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64, ctypes.c_int]
    lib.prvrlab_random_fill.restype = None
    lib.prvrlab_dropout_mask.argtypes = [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64, ctypes.c_int, ctypes.c_int, ctypes.c_uint32, ctypes.c_int
    ]
    lib.prvrlab_dropout_mask.restype = None


# load(): the built library (built on first use) or None; unavailable_reason(): why None
load, unavailable_reason = native.loader(SOURCE, abi_symbol="prvrlab_random_abi", abi=ABI, declare=_declare)


def random_words(n: int) -> Tensor:
    """(n,) int64 CPU tensor of uniformly random 64-bit words (module docstring)."""
    out = torch.empty(n, dtype=torch.int64)
    lib = load()
    if lib is None:
        return out.random_(-(2**63), None)
    lib.prvrlab_random_fill(out.data_ptr(), n, _seed(), torch.get_num_threads())
    return out


def _seed() -> int:
    """One draw of torch's default CPU generator: the seed of a sequence of words."""
    return int(torch.empty((), dtype=torch.int64).random_())


def random_mask(shape: tuple[int, ...], threshold: int, scale: Tensor) -> Tensor | None:
    """A CPU tensor of ``shape`` and ``scale``'s dtype (2 or 4 bytes an element): ``scale`` where the int16 view
    of :func:`random_words` ``((n + 3) // 4)`` (same seed draw) is at least ``threshold`` (in [-32768, 32767]),
    else 0; None without the kernel (nothing drawn)."""
    lib = load()
    if lib is None or scale.element_size() not in (2, 4):
        return None
    out = torch.empty(shape, dtype=scale.dtype)
    bits = int(scale.view(torch.int16 if scale.element_size() == 2 else torch.int32)) & 0xFFFFFFFF
    lib.prvrlab_dropout_mask(out.data_ptr(), out.numel(), _seed(), torch.get_num_threads(), threshold, bits, scale.element_size())
    return out
