"""settle_vector_math (prvrlab/vector_math.py): every VML function once per float dtype, on one element."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from prvrlab.vector_math import VML_FUNCTIONS, settle_vector_math


class _Calls(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, torch.dtype, int]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if getattr(func, "__name__", "") in VML_FUNCTIONS:
            self.seen.append((func.__name__, args[0].dtype, args[0].numel()))
        return out


def test_each_function_runs_once_per_float_dtype_on_a_single_element():
    with _Calls() as calls:
        settle_vector_math()
    want = [(name, dtype, 1) for dtype in (torch.float32, torch.float64) for name in VML_FUNCTIONS]
    assert sorted(calls.seen, key=str) == sorted(want, key=str)
    assert len(set(VML_FUNCTIONS)) == len(VML_FUNCTIONS) >= 20


def test_every_name_is_a_torch_function_with_one_half_in_its_domain():
    for name in VML_FUNCTIONS:
        value = getattr(torch, name)(torch.tensor([0.5], dtype=torch.float64))
        assert torch.isfinite(value).all(), name
