"""Packed rows <-> padded (B, ..., L, ...) layouts in one pass: ``row_chunks.cpp`` built on first use, called
through ctypes.

Attention runs on padded (B, G, L, Dh) heads while the rest of a GMMFormer block runs on packed (N, D)
tokens (:mod:`prvrlab.models.gmm`, ``_HeadLayout`` and ``_MergeHeads``).  PyTorch moves the rows with
advanced indexing: a zero fill of the whole padded tensor, then a scatter (or gather) through its generic
index kernels, ~10x slower than the memory they touch, and a ``stack`` of the three gathered Q/K/V
gradients.  Here every destination chunk (one token's Dh values of one head) is written once: copied from
its source, or zeroed on padding.

Build: :mod:`prvrlab.models.native`; :func:`load` returns None without it (:func:`unavailable_reason`
says why) and the callers keep PyTorch's path.  Threads: ``torch.get_num_threads()`` ranges of rows (of
middle indices where the destination is the padded side).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import Tensor

from prvrlab.models import native

SOURCE = Path(__file__).with_name("row_chunks.cpp")
ABI = 2  # prvrlab_chunks_abi() of a library this module can call


def _declare(lib: ctypes.CDLL) -> None:
    lib.prvrlab_move_chunks.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] + [ctypes.c_void_p] * 2 + [
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int,
        ctypes.c_int,
    ]
    lib.prvrlab_move_chunks.restype = None
    lib.prvrlab_gather_rows_bf16.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_int]
    lib.prvrlab_gather_rows_bf16.restype = None


# load(): the built library (built on first use) or None; unavailable_reason(): why None
load, unavailable_reason = native.loader(SOURCE, abi_symbol="prvrlab_chunks_abi", abi=ABI, declare=_declare)


def usable(*tensors: Tensor) -> bool:
    """Whether :func:`move_chunks` can take these tensors: the kernel is built and every one is a contiguous
    CPU tensor."""
    return all(t.device.type == "cpu" and t.is_contiguous() for t in tensors) and load() is not None


def _span(base: Tensor, mid: Tensor) -> tuple[int, int]:
    """The smallest and largest ``base[n] + mid[m]`` (0, -1 where there is none)."""
    if base.numel() == 0 or mid.numel() == 0:
        return 0, -1
    return int(base.min()) + int(mid.min()), int(base.max()) + int(mid.max())


def _check_chunks(
    dst: Tensor, src: Tensor, dst_base: Tensor, src_base: Tensor, dst_mid: Tensor, src_mid: Tensor, chunk: int,
    pad_base: Tensor | None,
) -> None:
    """ValueError unless the offsets pair up (one source row and middle offset per destination one) and every
    chunk, copied or zeroed, lies inside its tensor."""
    if dst_base.numel() != src_base.numel() or dst_mid.numel() != src_mid.numel():
        raise ValueError(
            f"move_chunks: {dst_base.numel()} destination rows against {src_base.numel()} source rows, "
            f"{dst_mid.numel()} destination middle offsets against {src_mid.numel()} source ones"
        )
    if chunk < 0:
        raise ValueError(f"move_chunks: chunk must be >= 0, got {chunk}")
    sides = [("destination", dst, dst_base, dst_mid), ("source", src, src_base, src_mid)]
    if pad_base is not None:
        sides.append(("padding", dst, pad_base, dst_mid))
    for name, tensor, base, mid in sides:
        low, high = _span(base, mid)
        if high >= low and (low < 0 or high + chunk > tensor.numel()):
            raise ValueError(
                f"move_chunks: a {name} chunk spans elements {low}..{high + chunk - 1}, outside the "
                f"{tensor.numel()} of its tensor"
            )


def move_chunks(
    dst: Tensor,
    src: Tensor,
    dst_base: Tensor,
    src_base: Tensor,
    dst_mid: Tensor,
    src_mid: Tensor,
    chunk: int,
    pad_base: Tensor | None = None,
    padded_dst: bool | None = None,
) -> Tensor:
    """Copy ``src``'s chunks of ``chunk`` elements into ``dst`` (both contiguous, one dtype) and zero its
    padding's; returns ``dst``.  Offsets are int64 element offsets: chunk (n, m) goes from
    ``src_base[n] + src_mid[m]`` to ``dst_base[n] + dst_mid[m]``; ``pad_base`` (P,) rows get zeros at
    ``pad_base[p] + dst_mid[m]``.  ``padded_dst`` (default: whether ``pad_base`` is given): ``dst`` is the
    padded side, written one middle index at a time (else one row at a time), which keeps the writes in
    sequence.  Every chunk must lie inside both tensors: checked here (a few reductions over the offsets),
    ValueError otherwise, so that no call reads or writes outside them."""
    lib = load()
    if lib is None:
        raise RuntimeError(f"the row-chunk kernel is unavailable: {unavailable_reason()}")
    if dst.dtype != src.dtype or not usable(dst, src):
        raise ValueError("move_chunks takes contiguous CPU tensors of one dtype")
    _check_chunks(dst, src, dst_base, src_base, dst_mid, src_mid, chunk, pad_base)
    size = dst.element_size()
    offsets = [t.to(torch.int64).mul(size).contiguous() for t in (dst_base, src_base, dst_mid, src_mid)]
    pads = torch.empty(0, dtype=torch.int64, device="cpu") if pad_base is None else pad_base.to(torch.int64).mul(size).contiguous()
    lib.prvrlab_move_chunks(
        dst.data_ptr(),
        src.data_ptr(),
        offsets[0].data_ptr(),
        offsets[1].data_ptr(),
        offsets[0].numel(),
        offsets[2].data_ptr(),
        offsets[3].data_ptr(),
        offsets[2].numel(),
        chunk * size,
        pads.data_ptr(),
        pads.numel(),
        int(pad_base is not None if padded_dst is None else padded_dst),
        torch.get_num_threads(),
    )
    return dst


def gather_rows_bf16(x: Tensor, index: Tensor) -> Tensor | None:
    """``x.index_select(0, index).to(torch.bfloat16)`` in one pass (the same values; a NaN's bits may differ) for a contiguous float32 CPU
    ``x`` (M, *F) that autograd does not record and (N,) ``index`` in [0, M) (ValueError otherwise); None
    where the kernel cannot take ``x`` (not such a tensor, or no kernel)."""
    if (x.dtype != torch.float32 or x.dim() < 1 or not usable(x) or (x.requires_grad and torch.is_grad_enabled())):
        return None
    index = index.to(torch.int64).contiguous()
    if index.dim() != 1 or index.device.type != "cpu":
        return None
    if index.numel() and not (0 <= int(index.min()) and int(index.max()) < x.shape[0]):
        raise ValueError(f"gather_rows_bf16: row indices outside the {x.shape[0]} rows of the source")
    out = torch.empty((index.numel(), *x.shape[1:]), dtype=torch.bfloat16, device="cpu")
    width = x[0].numel() if x.shape[0] else 0
    load().prvrlab_gather_rows_bf16(out.data_ptr(), x.data_ptr(), index.data_ptr(), index.numel(), width,
                                    torch.get_num_threads())
    return out
