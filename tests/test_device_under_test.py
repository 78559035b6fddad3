"""The suite's tensors are created on the device PRVRLAB_TEST_DEVICE names (cpu unless set)."""

import os

import torch

from device_under_test import DEVICE


def test_tensors_and_modules_are_created_on_the_device_under_test():
    expected = os.environ.get("PRVRLAB_TEST_DEVICE") or "cpu"
    assert DEVICE.type == torch.device(expected).type
    assert torch.zeros(2).device.type == DEVICE.type
    assert torch.nn.Linear(3, 2).weight.device.type == DEVICE.type


def test_autocast_runs_matrix_products_in_bf16_on_that_device():
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        product = a @ b
    assert product.dtype == torch.bfloat16 and product.device.type == DEVICE.type
    assert torch.allclose(product.float(), a @ b, rtol=0.05, atol=0.1)
