"""Where low-precision matrix products run natively, and exact bf16 products for fp32 scores."""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator

import torch
from torch import Tensor


@functools.lru_cache(maxsize=8)
def native_low_precision(device_type: str) -> bool:
    """Whether bf16 matrix products run on native units on ``device_type`` (a CUDA GPU; a CPU with AMX or AVX512-BF16)."""
    if device_type != "cpu":
        return True
    probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)


def bf16_exact(x: Tensor) -> bool:
    """Whether every value of the floating tensor ``x`` is a bfloat16 value (a bf16 tensor, or a wider
    one whose values round-trip through bf16 unchanged: what bf16 autocast produced, cast up)."""
    return x.dtype == torch.bfloat16 or torch.equal(x, x.to(torch.bfloat16).to(x.dtype))


# (parameter id, dtype) -> (the cast, the parameter's version when cast, the parameter: held, so that its
# id names no other tensor while the cache lives), inside kept_casts only
_CASTS: contextvars.ContextVar[dict[tuple[int, torch.dtype], tuple[Tensor, int, Tensor]] | None] = contextvars.ContextVar(
    "prvrlab_kept_casts", default=None
)


@contextlib.contextmanager
def kept_casts(enabled: bool = True) -> Iterator[None]:
    """Inside, :func:`weight_cast` casts each parameter once instead of once per batch (let go on exit).

    For an encoding loop under autocast: the fused paths (:func:`~prvrlab.models.blocks.branch_mlp`,
    :func:`~prvrlab.models.blocks.project`) cast their weights themselves, and v2's 35 M parameters
    cast per 8-video batch cost 6-10% of its video encoding in bf16.  (Autocast's own cache does not
    help there: torch keeps no casts under ``inference_mode`` and drops them when an autocast block
    exits.)  The same values: a cast is elementwise and made again after the parameter changes.
    """
    if not enabled:
        yield
        return
    token = _CASTS.set({})
    try:
        yield
    finally:
        _CASTS.reset(token)


def weight_cast(t: Tensor, dtype: torch.dtype, rows: slice = slice(None)) -> Tensor:
    """``t[rows].to(dtype)``.  Inside :func:`kept_casts`, without autograd, a parameter is cast whole once
    (again after it changes) and ``rows`` sliced from that cast; elsewhere only ``rows`` are cast (a
    training step over one branch at a time casts that branch's weights, not all K)."""
    whole = rows == slice(None)
    cache = _CASTS.get()
    if cache is None or t.dtype == dtype or torch.is_grad_enabled() or not isinstance(t, torch.nn.Parameter):
        return (t if whole else t[rows]).to(dtype)
    key = (id(t), dtype)
    hit = cache.get(key)
    if hit is None or hit[1] != t._version:
        hit = cache[key] = (t.to(dtype), t._version, t)
    return hit[0] if whole else hit[0][rows]


def _mkldnn_matmul():
    """``torch.backends.mkldnn.matmul`` where this torch has its ``fp32_precision`` setting, else None."""
    matmul = getattr(torch.backends.mkldnn, "matmul", None)
    return matmul if matmul is not None and hasattr(matmul, "fp32_precision") else None


@contextlib.contextmanager
def bf16_products(enabled: bool = True) -> Iterator[bool]:
    """Float32 matrix products on the CPU's bf16 units (oneDNN's bf16 math mode) inside the block.

    Inputs are rounded to bf16, products accumulate and come out in float32.  For inputs whose values
    are already bf16 (:func:`bf16_exact`) nothing is rounded: each product is exact in float32 and the
    result is the float32 product up to the order of summation, 3-4x faster on AMX.  Yields whether
    the mode is on: only where ``enabled``, the CPU has native bf16 units and this torch has the
    setting; the previous setting is restored on exit.
    """
    matmul = _mkldnn_matmul()
    if not (enabled and matmul is not None and native_low_precision("cpu")):
        yield False
        return
    before = matmul.fp32_precision
    matmul.fp32_precision = "bf16"
    try:
        yield True
    finally:
        matmul.fp32_precision = before
