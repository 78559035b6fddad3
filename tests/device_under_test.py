"""The device the suite runs its model, loss and evaluation tensors on.

``PRVRLAB_TEST_DEVICE`` (default ``cpu``): set it to ``cuda`` on a GPU machine and
tests/conftest.py makes it torch's default device, so every tensor and module a
test creates without naming a device lands there; tests that name a device, a
generator's device or an autocast device type use :data:`DEVICE` instead of ``"cpu"``.
"""

from __future__ import annotations

import os

import torch

DEVICE = torch.device(os.environ.get("PRVRLAB_TEST_DEVICE") or "cpu")


def as_a_program() -> torch.device:
    """``with as_a_program():`` runs the platform's own code as ``prvrlab train`` runs it: torch's default
    device the CPU, the device under test reached through the config (``train.use_gpu``) alone. Under a CUDA
    default device torch's DataLoader draws its base seed on the GPU from the loader's CPU generator and fails."""
    return torch.device("cpu")

