"""``resolve_amp_dtype``: every spelling it accepts, and refusals that name what was given and what is valid."""

from __future__ import annotations

import pytest
import torch

from prvrlab.evaluation.retrieval import resolve_amp_dtype


@pytest.mark.parametrize(
    "given, expected",
    [(None, None), ("none", None), ("NONE", None), ("bf16", torch.bfloat16), ("BFloat16", torch.bfloat16),
     ("fp16", torch.float16), ("float16", torch.float16), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)],
)
def test_accepted_spellings(given, expected):
    assert resolve_amp_dtype(given) is expected


@pytest.mark.parametrize("given", ["int8", "fp32", "", "bf-16"])
def test_an_unknown_name_is_refused_naming_it_and_the_valid_ones(given):
    with pytest.raises(ValueError) as err:
        resolve_amp_dtype(given)
    assert str(err.value) == f"amp_dtype must be one of 'none', 'bf16', 'fp16', got {given!r}"


@pytest.mark.parametrize("given", [torch.float32, torch.float64, torch.int8])
def test_a_dtype_that_is_no_half_precision_is_refused(given):
    with pytest.raises(ValueError) as err:
        resolve_amp_dtype(given)
    assert str(err.value) == f"amp_dtype must be torch.bfloat16 or torch.float16, got {given!r}"
