"""Tests of the CPU kernels run on the CPU whatever ``PRVRLAB_TEST_DEVICE`` names.

Under ``PRVRLAB_TEST_DEVICE=cuda`` tests/conftest.py makes CUDA torch's default device.  These modules test
CPU-only kernels and draw their inputs from CPU generators (``torch.Generator()``), which a CUDA default
device refuses; they name no device of their own, so they run inside ``torch.device("cpu")`` (as
test_fused_scan.py does for its kernel).  On the CPU this changes nothing.
"""

from __future__ import annotations

import pytest
import torch

CPU_KERNEL_MODULES = frozenset({
    "test_adam_step", "test_batch_windows", "test_branch_mix", "test_column_sum", "test_embeddings",
    "test_kernel_threads", "test_layer_norm", "test_random_bits", "test_residual_draw", "test_row_chunks",
    "test_scoring", "test_summary_pool", "test_window_best", "test_window_softmax", "test_winners",
})


@pytest.fixture(autouse=True)
def _cpu_kernels_on_the_cpu(request):
    if request.path.stem in CPU_KERNEL_MODULES:
        with torch.device("cpu"):
            yield
    else:
        yield
