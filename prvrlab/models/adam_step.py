"""The reference optimiser's update in one pass on CPU: ``adam_step.cpp`` built on first use, called through ctypes.

:class:`prvrlab.platform.train.optim.BertAdam` updates its parameters with nine foreach passes over memory
(two multiplies, two adds with alpha, an addcmul, a sqrt, an add, a divide, the weight decay, the step).  For a
GMMFormer v2 of 32.3 M float32 parameters on this kind of 2-core CPU they took 83 ms a step (122-131 ms with
per-tensor clipping); the kernel reads each element once and takes 19.5 ms (32 ms) (``benchmarks/bench_model_step.py``
prints the optimiser's share of a step).  Each operation rounds as the foreach form's ATen op does where ATen runs
its AVX2 / AVX-512 kernels (elsewhere :func:`takes` is False), except the square root, which is correctly rounded
here and not in ATen (MKL's vectorised one is one ulp off for ~0.7% of elements; see also
:mod:`prvrlab.vector_math`): an element can differ from the foreach form in its last bit
(``tests/models/test_adam_step.py`` checks the kernel against the foreach form and against the formula in float64).

Build: :mod:`prvrlab.models.native` (IEEE arithmetic, ``fast_math=False``); without it (:func:`unavailable_reason`
says why), or for tensors it does not take (:func:`takes`), the caller keeps its foreach form.  Threads:
``torch.get_num_threads()`` ranges of the elements.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor

from prvrlab.models import native

SOURCE = Path(__file__).with_name("adam_step.cpp")
ABI = 1  # prvrlab_adam_step_abi() of a library this module can call

_declare = native.void_functions(
    prvrlab_adam_step=[ctypes.c_void_p] * 6 + [ctypes.c_int64] + [ctypes.c_float] * 7 + [ctypes.c_int],
)

# load(): the built library (built on first use) or None; unavailable_reason(): why None
load, unavailable_reason = native.loader(
    SOURCE, abi_symbol="prvrlab_adam_step_abi", abi=ABI, declare=_declare, fast_math=False
)


# ATen CPU kernels whose add-with-alpha is a fused multiply-add, as the kernel's (the DEFAULT ones round twice)
FMA_CAPABILITIES = ("AVX2", "AVX512")


def takes(*tensor_lists: Sequence[Tensor]) -> bool:
    """Whether the kernel can update these tensors as the foreach form would: every one a contiguous, dense
    float32 CPU tensor, no two sharing memory (a tied weight listed twice, overlapping views: the foreach form
    updates them one after the other, the kernel's threads would race), ATen running FMA kernels
    (:data:`FMA_CAPABILITIES`), and the kernel built."""
    spans = []
    for tensors in tensor_lists:
        for t in tensors:
            if t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous() or t.is_sparse:
                return False
            if t.numel():
                spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
    spans.sort()
    if any(later[0] < earlier[1] for earlier, later in zip(spans, spans[1:])):
        return False
    return torch.backends.cpu.get_cpu_capability() in FMA_CAPABILITIES and load() is not None


def step(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avg: Sequence[Tensor], exp_avg_sq: Sequence[Tensor],
         *, scales: Sequence[float] | None, lr: float, b1: float, b2: float, eps: float, weight_decay: float) -> None:
    """One BertAdam update in place of ``params``, ``exp_avg`` and ``exp_avg_sq`` (same-shaped lists that
    :func:`takes`), each gradient first multiplied by its ``scales`` entry (None: no clipping)::

        m = m * b1 + (1 - b1) g;  v = v * b2 + (1 - b2) g g;  p = p - lr (m / (sqrt(v) + eps) + weight_decay p)

    ``weight_decay`` <= 0: none."""
    count = len(params)
    if not (len(grads) == len(exp_avg) == len(exp_avg_sq) == count):
        raise ValueError("params, grads, exp_avg and exp_avg_sq must be lists of one length")
    if scales is not None and len(scales) != count:
        raise ValueError(f"scales must give one factor per tensor ({count}), got {len(scales)}")
    for i, p in enumerate(params):
        if not (grads[i].shape == exp_avg[i].shape == exp_avg_sq[i].shape == p.shape):
            raise ValueError(f"tensor {i}: grad, exp_avg and exp_avg_sq must have the parameter's shape {tuple(p.shape)}")
    if count == 0:
        return

    def pointers(tensors: Sequence[Tensor]):
        return (ctypes.c_void_p * count)(*(t.data_ptr() for t in tensors))

    sizes = (ctypes.c_int64 * count)(*(t.numel() for t in params))
    factors = (ctypes.c_float * count)(*([1.0] * count if scales is None else scales))
    load().prvrlab_adam_step(
        pointers(params), pointers(grads), pointers(exp_avg), pointers(exp_avg_sq), sizes, factors, count,
        b1, 1 - b1, b2, 1 - b2, eps, weight_decay if weight_decay > 0 else 0.0, -lr, torch.get_num_threads())
    for t in (*params, *exp_avg, *exp_avg_sq):
        torch.autograd.graph.increment_version(t)
