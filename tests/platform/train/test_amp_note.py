"""The driver's warning for bf16 autocast on a CPU that only emulates bf16."""

from __future__ import annotations

import pytest

from prvrlab.platform.config import validate
from prvrlab.platform.train.driver import amp_note

from train_helpers import small_raw


@pytest.mark.parametrize(
    ("amp", "use_gpu", "native", "warned"),
    [
        ("bf16", False, False, True),  # emulated on this CPU: slower than fp32
        ("bf16", False, True, False),  # AMX / AVX512-BF16
        ("none", False, False, False),
        ("bf16", True, False, False),  # the workers' GPUs do bf16
    ],
)
def test_bf16_without_native_units_is_named(tiny_root, tmp_path, amp, use_gpu, native, warned):
    raw = small_raw(tiny_root, tmp_path)
    raw["train"].update(amp=amp, use_gpu=use_gpu)
    note = amp_note(validate(raw), native=native)
    assert (note is not None) == warned
    if warned:
        assert "train.amp=bf16" in note and "train.amp=none" in note
