"""A checkpoint's random state: a resumed run continues the CPU's stream and, on a GPU, the device's
(dropout draws there). ``torch.load(map_location=<the training device>)`` moves the saved states onto the
GPU, and torch's generators take CPU byte tensors only: resuming on a GPU failed before the states were
brought back (found by the CUDA run of test_resident_train's resumed run)."""

from __future__ import annotations

import torch

from prvrlab.platform.train.loop import random_state, restore_random_state

from device_under_test import DEVICE


def _draws(device: torch.device) -> list[list[float]]:
    return [torch.rand(4, device="cpu").tolist(), torch.rand(4, device=device).tolist()]


def test_a_restored_state_continues_the_cpu_and_device_streams(tmp_path):
    torch.manual_seed(5)
    torch.save(random_state(DEVICE), tmp_path / "state.pt")
    want = _draws(DEVICE)
    _draws(DEVICE)  # both streams move on
    saved = torch.load(tmp_path / "state.pt", map_location=DEVICE, weights_only=True)  # as TrainingLoop.restore
    assert set(saved) == ({"rng", "cuda_rng"} if DEVICE.type == "cuda" else {"rng"})
    restore_random_state(saved, DEVICE)
    assert _draws(DEVICE) == want


def test_a_checkpoint_without_the_device_state_restores_the_cpu_stream(tmp_path):
    torch.manual_seed(5)
    saved = {"rng": torch.get_rng_state()}  # what checkpoints held before the device's state was saved
    want = torch.rand(4, device="cpu").tolist()
    restore_random_state(saved, DEVICE)
    assert torch.rand(4, device="cpu").tolist() == want


class _OnTheGpu:
    """A saved state as ``torch.load(map_location="cuda")`` returns it, for a CPU-only machine: not a CPU
    tensor (``torch.set_rng_state`` refuses it), but ``.cpu()`` brings it back."""

    def __init__(self, state: torch.Tensor) -> None:
        self.state = state

    def cpu(self) -> torch.Tensor:
        return self.state


def test_a_state_that_map_location_moved_is_brought_back_to_the_cpu():
    torch.manual_seed(5)
    saved = {"rng": _OnTheGpu(torch.get_rng_state())}
    want = torch.rand(4, device="cpu").tolist()
    restore_random_state(saved, torch.device("cpu"))
    assert torch.rand(4, device="cpu").tolist() == want
