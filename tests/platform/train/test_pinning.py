"""Which devices get page-locked training batches (``data.pin_memory``)."""

from pathlib import Path

import pytest
import torch

from prvrlab.platform.config import apply_overrides, load_raw, validate
from prvrlab.platform.train.loop import pin_batches

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "gmmformer_synth.yaml"


@pytest.mark.parametrize(
    "device, setting, pinned",
    [
        ("cuda", None, True),  # the default pins for a GPU
        ("cuda", True, True),
        ("cuda", False, False),  # switched off by the config
        ("cuda:1", None, True),
        ("cpu", None, False),  # nothing to copy to
        ("cpu", True, False),  # asked for, but a CPU run has no device copy to speed up
    ],
)
def test_batches_are_pinned_only_for_a_cuda_device_unless_switched_off(device, setting, pinned):
    assert pin_batches(torch.device(device), setting) is pinned


def test_the_config_key_defaults_to_automatic_and_takes_a_bool():
    raw = load_raw(CONFIG)
    assert validate(raw).data.pin_memory is None
    assert validate(apply_overrides(raw, {"data.pin_memory": False})).data.pin_memory is False
