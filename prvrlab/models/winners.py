"""The winners of :func:`~prvrlab.models.scoring.max_scores`' training maxima on CPU: ``winners.cpp`` built on
first use (without ``-ffast-math``), called through ctypes.

With autograd, ``max_scores`` finds each (query, video) pair's winning vector without recording, then
takes the gradient through that one dot.  PyTorch found the winners in six passes over the (Nq, C, L)
float32 dots: the (Nq, C, L) denominators, the cosines, a masked fill, a masked copy of the dots and two
``argmax`` (v2's frame scores, 640 x 128 x 128: 37 ms a step, in either precision).  The kernel reads the
dots once and computes the same quotients, so its winners are torch's, NaN and ties included
(``tests/models/test_winners.py``).

Build: :mod:`prvrlab.models.native`; without it (:func:`unavailable_reason` says why), or for tensors off the
CPU, :func:`winners` returns None and the caller keeps PyTorch's passes.  Threads:
``torch.get_num_threads()`` ranges of (query, video) pairs.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import Tensor

from prvrlab.models import native

SOURCE = Path(__file__).with_name("winners.cpp")
ABI = 1  # prvrlab_winners_abi() of a library this module can call

_declare = native.void_functions(
    prvrlab_winners=[ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
)

# load(): the built library (built on first use) or None; unavailable_reason(): why None
load, unavailable_reason = native.loader(
    SOURCE, abi_symbol="prvrlab_winners_abi", abi=ABI, declare=_declare, fast_math=False
)


def winners(dots: Tensor, q_norm: Tensor, v_norm: Tensor, pad: Tensor | None, with_logits: bool) -> Tensor | None:
    """(Nq, C, 1) int64 indices over L of ``argmax(dots / (q_norm * v_norm))`` with -inf on ``pad``, and with
    ``with_logits`` a second column, ``argmax(dots)`` with the float32 minimum on ``pad``: (Nq, C, 2).  ``dots``
    (Nq, C, L) float32, ``q_norm`` (Nq,), ``v_norm`` (C, L), ``pad`` (1, C, L) bool (True: padding) or None.
    None where the kernel does not take them (not all float32 on the CPU, L = 0 or L >= 2^31: its
    positions are packed into 32 bits, or no kernel)."""
    nq, c, length = dots.shape
    tensors = (dots, q_norm, v_norm)
    if not 0 < length < 2**31 or not all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors):
        return None
    if tuple(q_norm.shape) != (nq,) or tuple(v_norm.shape) != (c, length):
        raise ValueError(f"norms of shapes {tuple(q_norm.shape)} and {tuple(v_norm.shape)} for dots of {tuple(dots.shape)}")
    if pad is not None and tuple(pad.shape) != (1, c, length):
        raise ValueError(f"a padding mask of shape {tuple(pad.shape)} for dots of {tuple(dots.shape)}")
    lib = load()
    if lib is None:
        return None
    dots, q_norm, v_norm = (t.contiguous() for t in tensors)
    real = None if pad is None else (~pad[0].to(torch.bool)).to(torch.uint8).contiguous()  # (C, L)
    out = torch.empty(nq, c, 2 if with_logits else 1, dtype=torch.int64, device="cpu")  # (Nq, C, W)
    lib.prvrlab_winners(dots.data_ptr(), q_norm.data_ptr(), v_norm.data_ptr(), 0 if real is None else real.data_ptr(),
                        nq, c, length, int(with_logits), out.data_ptr(), torch.get_num_threads())
    return out
