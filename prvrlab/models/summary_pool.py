"""GMMFormer v2's learned-query summary pooling on packed tokens, fused on CPU: ``summary_pool.cpp`` built on
first use, called through ctypes.

The summary (:class:`prvrlab.models.gmmformer_v2.LearnedQueryAttention`) pools each video's tokens of
every branch with its H = 4 heads' softmax weights, ``pooled[k, b, h] = sum_n p[k, n, h] x[k, n]``.  In
PyTorch that unpacks x to a padded (K, B, L, D) copy for a batched (4 x L)(L x D) product, whose
backward runs (L x 4)(4 x D) products and packs the gradient back: v2's frames at batch 128 ((8, 9,807,
384) bf16 on an AMX CPU), forward + backward 43.6 ms.  The kernels read the packed tokens in place, once
per pass, sum in float32 and round each output once: 19.6 ms, the same values to summation order
(``tests/models/test_summary_pool.py``).  (The attention logits ``x uᵀ`` stay a PyTorch product: a
kernel for their backward was tried and ran at a quarter of oneDNN's speed.)

Build: :mod:`prvrlab.models.native`; without it (:func:`unavailable_reason` says why), on other devices and
for float32, :func:`takes` is False and the caller keeps PyTorch's path.  Threads:
``torch.get_num_threads()`` ranges of (branch, video) pairs.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import Tensor

from prvrlab.models import native
from prvrlab.models.blocks import Packing

SOURCE = Path(__file__).with_name("summary_pool.cpp")
ABI = 1  # prvrlab_summary_pool_abi() of a library this module can call


_declare = native.void_functions(
    prvrlab_summary_pool=[ctypes.c_void_p] * 4 + [ctypes.c_int64] * 5 + [ctypes.c_int],
    prvrlab_summary_pool_backward=[ctypes.c_void_p] * 6 + [ctypes.c_int64] * 5 + [ctypes.c_int],
)

# load(): the built library (built on first use) or None; unavailable_reason(): why None
load, unavailable_reason = native.loader(SOURCE, abi_symbol="prvrlab_summary_pool_abi", abi=ABI, declare=_declare)


def takes(x: Tensor) -> bool:
    """Whether the kernels take the (K, N, D) packed tokens ``x``: a bf16 CPU tensor with elements, built."""
    return x.device.type == "cpu" and x.dtype == torch.bfloat16 and x.numel() > 0 and load() is not None


def segment_offsets(packing: Packing) -> Tensor:
    """(B + 1,) int64: the packed rows of video b are ``[off[b], off[b + 1])`` (all L slots of a row when
    nothing is packed away, a grid's padded slots included, as the summary attends to them there)."""
    B, L = packing.batch, packing.length
    if packing.index is None:
        return torch.arange(B + 1, dtype=torch.int64, device="cpu") * L
    index = packing.index.cpu()
    if index.numel() > 1 and not bool((index[1:] > index[:-1]).all()):
        raise ValueError("packed tokens must be in row order for the summary's segments")
    return torch.cat([torch.zeros(1, dtype=torch.int64, device="cpu"), packing.lengths.cpu().to(torch.int64).cumsum(0)])


def pool(p: Tensor, x: Tensor, offsets: Tensor) -> Tensor:
    """``pooled[k, b, h] = sum_n p[k, n, h] x[k, n]`` over video b's rows ``[offsets[b], offsets[b + 1])``:
    (K, N, H) weights and (K, N, D) tokens, both bf16 (:func:`takes`) -> (K, B, H, D)."""
    if (x.dim() != 3 or p.dim() != 3 or tuple(p.shape[:2]) != tuple(x.shape[:2]) or p.dtype != x.dtype
            or p.device.type != "cpu" or not takes(x)):
        raise ValueError(f"pool takes (K, N, H) weights and (K, N, D) tokens, both bf16 CPU tensors, got "
                         f"{tuple(p.shape)} {p.dtype} on {p.device} and {tuple(x.shape)} {x.dtype} on {x.device}")
    K, N, D = x.shape
    B = offsets.shape[0] - 1 if offsets.dim() == 1 else -1
    if (B < 0 or offsets.dtype != torch.int64 or offsets.device.type != "cpu" or int(offsets[0]) != 0
            or int(offsets[-1]) != N or bool((offsets[1:] < offsets[:-1]).any())):
        raise ValueError(f"offsets must be (B + 1,) int64 CPU values rising from 0 to N = {N}")
    return _Pool.apply(p, x, offsets.contiguous())


class _Pool(torch.autograd.Function):
    @staticmethod
    def forward(ctx, p: Tensor, x: Tensor, offsets: Tensor) -> Tensor:
        K, N, D = x.shape
        H, B = p.shape[2], offsets.shape[0] - 1
        p, x = p.contiguous(), x.contiguous()
        out = x.new_empty((K, B, H, D))
        load().prvrlab_summary_pool(p.data_ptr(), x.data_ptr(), offsets.data_ptr(), out.data_ptr(), K, N, B, H, D,
                                    torch.get_num_threads())
        ctx.save_for_backward(p, x, offsets)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        p, x, offsets = ctx.saved_tensors
        need_p, need_x, _ = ctx.needs_input_grad
        K, N, D = x.shape
        H, B = p.shape[2], offsets.shape[0] - 1
        g = g.to(x.dtype).contiguous()  # (K, B, H, D)
        dp = torch.empty_like(p) if need_p else None
        dx = torch.empty_like(x) if need_x else None
        load().prvrlab_summary_pool_backward(
            g.data_ptr(), p.data_ptr(), x.data_ptr(), offsets.data_ptr(), 0 if dx is None else dx.data_ptr(),
            0 if dp is None else dp.data_ptr(), K, N, B, H, D, torch.get_num_threads())
        return dp, dx, None
