"""A per-token weighted sum of branch outputs, fused on CPU: ``branch_mix.cpp`` built on first use, called
through ctypes.

GMMFormer v2 aggregates its K branches per token, ``out[n] = sum_k w[n, k] * branches[k, n]``.  As an
einsum that is N batched (1 x K)(K x D) products forward and (K x 1)(1 x D) and (1 x D)(D x K) ones
backward, plus a copy of the branches into the batched layout: tiles that run at 7-17 GFLOP/s in bf16,
~50 ms of a v2 training step at batch 128 for what is ~100 MB of memory traffic ((9,786, 8, 384):
forward 10.1 ms, backward 25.2).  The kernel reads each element once per direction, sums in float32 and
rounds each output once, as the batched products do (2.9 and 7.8 ms): results equal the einsum's to
summation order (``tests/models/test_branch_mix.py``).

Build: :mod:`prvrlab.models.native`; without it (:func:`unavailable_reason` says why), on other devices or
dtypes (float32), :func:`mix` is the einsum.  Threads: ``torch.get_num_threads()`` ranges of tokens.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import Tensor

from prvrlab.models import native

SOURCE = Path(__file__).with_name("branch_mix.cpp")
ABI = 1  # prvrlab_branch_mix_abi() of a library this module can call


_declare = native.void_functions(
    prvrlab_branch_mix_forward=[ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int],
    prvrlab_branch_mix_backward=[ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_int],
)

# load(): the built library (built on first use) or None; unavailable_reason(): why None
load, unavailable_reason = native.loader(SOURCE, abi_symbol="prvrlab_branch_mix_abi", abi=ABI, declare=_declare)


def mix(weights: Tensor, branches: Tensor) -> Tensor:
    """``einsum("nk,knd->nd", weights, branches)``: (N, K) weights and (K, N, D) branches of one dtype ->
    (N, D), through the kernel for bf16 CPU tensors (module docstring; float32 keeps the einsum, as fast
    there: (9,786, 8, 384) forward + backward 14 ms against the kernel's 15)."""
    K, N, D = branches.shape
    if tuple(weights.shape) != (N, K) or weights.dtype != branches.dtype:
        raise ValueError(f"weights must be (N, K) = {(N, K)} in the branches' dtype {branches.dtype}, "
                         f"got {tuple(weights.shape)} {weights.dtype}")
    usable = all(t.device.type == "cpu" for t in (weights, branches)) and branches.dtype == torch.bfloat16
    if not usable or N * K * D == 0 or load() is None:
        return torch.einsum("nk,knd->nd", weights, branches)
    return _Mix.apply(weights, branches)


class _Mix(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weights: Tensor, branches: Tensor) -> Tensor:
        K, N, D = branches.shape
        w, br = weights.contiguous(), branches.contiguous()  # (N, K), (K, N, D)
        out = br.new_empty((N, D))
        load().prvrlab_branch_mix_forward(w.data_ptr(), br.data_ptr(), out.data_ptr(), N, K, D,
                                          torch.get_num_threads())
        ctx.save_for_backward(w, br)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        w, br = ctx.saved_tensors
        K, N, D = br.shape
        need_w, need_br = ctx.needs_input_grad
        g = g.to(br.dtype).contiguous()  # (N, D)
        dw = torch.empty_like(w) if need_w else None
        dbr = torch.empty_like(br) if need_br else None
        load().prvrlab_branch_mix_backward(
            g.data_ptr(), w.data_ptr(), br.data_ptr(), 0 if dbr is None else dbr.data_ptr(),
            0 if dw is None else dw.data_ptr(), N, K, D, torch.get_num_threads())
        return dw, dbr
