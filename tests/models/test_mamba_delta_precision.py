"""The Mamba mixer's delta bias is added, and softplus taken, in fp32 under bf16 autocast, as mamba_ssm's kernel
takes ``delta_bias`` in fp32: mamba_ssm's initial biases (~ -6.9 for a step of 1e-3) are 0.03 apart in bf16."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from prvrlab.models import mamba as mamba_module
from prvrlab.models.mamba import Mamba

from device_under_test import DEVICE


def test_delta_is_softplus_of_the_fp32_bias_under_autocast(monkeypatch):
    torch.manual_seed(0)
    m = Mamba(hidden_size=16)  # E = 32 channels
    m.init_like_mamba_ssm_()
    with torch.no_grad():
        m.dt_proj.weight.zero_()  # the product is 0 exactly in any precision: delta is the bias's alone
    bias = m.dt_proj.bias.detach().float()
    assert (bias < -4).any() and not torch.equal(bias.bfloat16().float(), bias)  # bf16 would round it
    seen = {}
    scan = mamba_module.selective_scan

    def spy(x, delta, *args, **kw):
        seen["delta"] = delta
        return scan(x, delta, *args, **kw)

    monkeypatch.setattr(mamba_module, "selective_scan", spy)
    with torch.autocast(device_type=DEVICE.type, dtype=torch.bfloat16):
        m(torch.randn(2, 5, 16))
    delta = seen["delta"]  # (B, L, E)
    assert delta.dtype == torch.float32
    assert torch.equal(delta, F.softplus(bias).expand_as(delta))
