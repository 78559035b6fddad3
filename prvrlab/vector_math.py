"""MKL's vector-math kernels settled on one thread before several threads use them (pytorch/pytorch#188792).

ATen computes float32 / float64 ``sqrt``, ``exp``, ``log``, ``tanh``, ``sin``, ``erf``, ... of a contiguous CPU
tensor with MKL's vector-math library (VML), each intra-op thread on its own range.  oneMKL picks each function's
kernel on its first call; when that first call runs on several threads at once, one of them can run a
low-accuracy kernel for its whole range.  Measured with torch 2.13 on an AMX Xeon, 2 threads, (300, 64) float32
inputs, one op per fresh process: ``sqrt`` 3,918 ulp off on a thread's half of the elements in 13 of 46
processes, ``exp`` in 1 of 12 (1,768 ulp), ``log`` 2 of 12, ``tanh`` 4 of 12, ``sin`` 2 of 12, ``erf`` 1 of 12,
``asin`` 8 of 12 (532 ulp); later calls are right.  So the first batch of a training or evaluation process could
differ from run to run, silently.

:func:`settle_vector_math` calls each function once on a one-element tensor, which runs on the calling thread
alone; after it no such race was seen (0 of 40 fresh processes for ``asin`` and ``tanh``, against 10 of 40
without; 0 of 46 for ``sqrt`` after a one-element call).  Training processes and ``prvrlab eval`` call it before
their first batch (``tests/platform/train/test_vector_math_setup.py``).  It costs ~2 ms in a fresh process.
"""

from __future__ import annotations

import torch

# the float functions ATen hands to VML (aten/src/ATen/cpu/vml.h), by their torch names
VML_FUNCTIONS: tuple[str, ...] = (
    "abs", "acos", "asin", "atan", "cos", "erf", "erfc", "erfinv", "exp", "expm1", "log", "log10", "log1p",
    "sin", "sqrt", "tan", "tanh", "trunc", "lgamma", "sinh", "cosh", "rsqrt",
)


def settle_vector_math() -> None:
    """Call every :data:`VML_FUNCTIONS` function once in float32 and float64 on a one-element CPU tensor (one
    thread), so that MKL picks its kernels before any multi-threaded call (module docstring)."""
    for dtype in (torch.float32, torch.float64):
        x = torch.full((1,), 0.5, dtype=dtype)  # inside every function's domain
        for name in VML_FUNCTIONS:
            getattr(torch, name)(x)
