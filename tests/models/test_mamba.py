"""The selective scan (chunked == step-by-step recurrence, gradients, masks, CUDA kernel) and the Mamba block."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from prvrlab.models import mamba
from prvrlab.models.blocks import Packing
from prvrlab.models.mamba import (
    Mamba,
    MambaLayer,
    _cuda_kernel,
    selective_scan,
    selective_scan_chunked,
    selective_scan_reference,
)
from device_under_test import DEVICE


def scan_inputs(batch=2, length=11, channels=3, state=4, *, seed=0, dtype=torch.float64, big_steps=False):
    g = torch.Generator(torch.get_default_device()).manual_seed(seed)  # the device under test, or the CPU's in test_fused_scan
    x = torch.randn(batch, length, channels, generator=g, dtype=dtype)
    delta = F.softplus(torch.randn(batch, length, channels, generator=g, dtype=dtype) * (4.0 if big_steps else 1.0))
    A = -torch.exp(torch.randn(channels, state, generator=g, dtype=dtype) + (2.0 if big_steps else 0.0))
    B = torch.randn(batch, length, state, generator=g, dtype=dtype)
    C = torch.randn(batch, length, state, generator=g, dtype=dtype)
    D = torch.randn(channels, generator=g, dtype=dtype)
    return x, delta, A, B, C, D


def test_reference_matches_a_hand_loop_over_every_channel_and_state():
    x, delta, A, B, C, D = scan_inputs(batch=1, length=4, channels=2, state=3)
    y = selective_scan_reference(x, delta, A, B, C, D)
    for e in range(2):
        h = [0.0, 0.0, 0.0]
        for t in range(4):
            d, u = float(delta[0, t, e]), float(x[0, t, e])
            h = [math.exp(d * float(A[e, n])) * h[n] + d * u * float(B[0, t, n]) for n in range(3)]
            expected = sum(float(C[0, t, n]) * h[n] for n in range(3)) + float(D[e]) * u
            assert float(y[0, t, e]) == pytest.approx(expected, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("length, chunk", [(1, 4), (7, 1), (8, 4), (11, 4), (13, 5), (16, 16), (5, 32), (40, 16)])
def test_chunked_scan_equals_the_recurrence(length, chunk):
    args = scan_inputs(length=length, seed=length)
    torch.testing.assert_close(
        selective_scan_chunked(*args, chunk=chunk), selective_scan_reference(*args), rtol=1e-10, atol=1e-10
    )


def test_chunked_scan_fp32_tight_and_stable_with_strong_decays():
    """Steps with delta * |A| far beyond exp's fp32 range (a cumulative log-decay of thousands) stay finite."""
    args = scan_inputs(batch=3, length=50, channels=6, state=16, seed=3, dtype=torch.float32, big_steps=True)
    ref = selective_scan_reference(*(a.double() for a in args))
    assert (torch.cumsum(args[1][..., None] * args[2], dim=1).min() < -1000).item()  # exp(-S) would overflow
    out = selective_scan_chunked(*args, chunk=16)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_no_skip_and_empty_sequence():
    x, delta, A, B, C, _ = scan_inputs(length=6)
    torch.testing.assert_close(selective_scan_chunked(x, delta, A, B, C, chunk=4), selective_scan_reference(x, delta, A, B, C))
    empty = selective_scan_chunked(x[:, :0], delta[:, :0], A, B[:, :0], C[:, :0], chunk=4)
    assert empty.shape == (2, 0, 3)


def test_mask_zeroes_padded_steps_and_trailing_padding_never_reaches_real_steps():
    x, delta, A, B, C, D = scan_inputs(length=9)
    mask = torch.tensor([[True] * 9, [True] * 5 + [False] * 4])
    masked = selective_scan_chunked(x, delta, A, B, C, D, mask=mask, chunk=4)
    torch.testing.assert_close(masked, selective_scan_reference(x, delta, A, B, C, D, mask=mask))
    plain = selective_scan_chunked(x, delta, A, B, C, D, chunk=4)
    torch.testing.assert_close(masked[mask], plain[mask])  # causal: real steps never see trailing padding
    # on padded steps the state is frozen: y_t = <C_t, h_last_real> (x zeroed, so no skip term)
    last = selective_scan_reference(x[1:, :5], delta[1:, :5], A, B[1:, :5], C[1:, :5])  # (1, 5, E)
    state = torch.zeros(3, 4, dtype=x.dtype)
    for t in range(5):
        state = torch.exp(delta[1, t, :, None] * A) * state + (delta[1, t] * x[1, t])[:, None] * B[1, t][None]
    torch.testing.assert_close(last[0, -1], (state * C[1, 4][None]).sum(-1))
    for t in range(5, 9):
        torch.testing.assert_close(masked[1, t], (state * C[1, t][None]).sum(-1))


def test_gradients_of_the_chunked_scan_equal_autograd_of_the_recurrence():
    args = [a.requires_grad_() for a in scan_inputs(length=10, seed=7)]
    weights = torch.randn(2, 10, 3, dtype=torch.float64)
    fast = torch.autograd.grad((selective_scan_chunked(*args, chunk=4) * weights).sum(), args)
    ref = torch.autograd.grad((selective_scan_reference(*args) * weights).sum(), args)
    for name, a, b in zip(("x", "delta", "A", "B", "C", "D"), fast, ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=name)


def test_gradcheck_of_the_chunked_scan():
    args = tuple(a.requires_grad_() for a in scan_inputs(batch=1, length=5, channels=2, state=2, seed=9))
    assert torch.autograd.gradcheck(lambda *a: selective_scan_chunked(*a, chunk=2), args)


def test_dispatch_runs_fp32_under_autocast_and_rejects_unknown_kernels():
    args = scan_inputs(length=6, dtype=torch.float32)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        y = selective_scan(*(a.bfloat16() for a in args))
    assert y.dtype == torch.float32
    with pytest.raises(ValueError, match="kernel"):
        selective_scan(*args, kernel="triton")


def test_chunked_scan_fp32_gradients_match_the_float64_recurrence():
    """The hand-written backward in fp32 against autograd of the recurrence in float64, several chunks."""
    args = scan_inputs(batch=3, length=40, channels=6, state=16, seed=5, dtype=torch.float32)
    weights = torch.randn(3, 40, 6, generator=torch.Generator(DEVICE).manual_seed(1))
    fast = [a.clone().requires_grad_() for a in args]
    ref = [a.double().requires_grad_() for a in args]
    got = torch.autograd.grad((selective_scan_chunked(*fast, chunk=16, block_elements=2 * 16 * 6 * 16) * weights).sum(), fast)
    want = torch.autograd.grad((selective_scan_reference(*ref) * weights.double()).sum(), ref)
    for name, a, b in zip(("x", "delta", "A", "B", "C", "D"), got, want):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5, msg=name)


def test_chunked_scan_keeps_only_the_states_entering_each_chunk():
    """Saved for the backward: the inputs and one (B, N, E) state per chunk, not the (B, L, E, N) states."""
    x, delta, A, B, C, D = (a.requires_grad_() for a in scan_inputs(batch=2, length=32, channels=5, state=4))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        selective_scan_chunked(x, delta, A, B, C, D, chunk=8)
    assert max(saved) == x.numel()  # the largest saved tensor is an input: (B, L, E)
    assert 4 * 2 * 4 * 5 in saved  # the entering states: (K = 4, B, N, E)


@pytest.mark.skipif(_cuda_kernel() is None or not torch.cuda.is_available(), reason="needs mamba_ssm and CUDA")
def test_cuda_kernel_agrees_with_the_chunked_scan(monkeypatch):  # pragma: no cover - CPU-only CI
    """The dispatch calls mamba_ssm's kernel on CUDA, and kernel and torch scan agree (outputs and gradients)."""
    import prvrlab.models.mamba as mamba

    calls = []
    kernel = mamba._cuda_kernel()
    monkeypatch.setattr(mamba, "_cuda_kernel", lambda: lambda *a, **k: calls.append(1) or kernel(*a, **k))
    device = torch.device("cuda")  # the kernel exists only there
    args = [a.to(device) for a in scan_inputs(batch=2, length=64, channels=32, state=16, dtype=torch.float32)]
    mask = torch.ones(2, 64, dtype=torch.bool, device=device)
    mask[1, 40:] = False
    weights = torch.randn(2, 64, 32, device=device)
    fast = [a.clone().requires_grad_() for a in args]
    torch_args = [a.clone().requires_grad_() for a in args]
    out = selective_scan(*fast, mask=mask)
    assert calls, "the CUDA kernel was not used"
    expected = selective_scan(*torch_args, mask=mask, kernel="torch")
    torch.testing.assert_close(out, expected, rtol=6e-4, atol=2e-3)
    got = torch.autograd.grad((out * weights).sum(), fast)
    want = torch.autograd.grad((expected * weights).sum(), torch_args)
    for name, a, b in zip(("x", "delta", "A", "B", "C", "D"), got, want):
        torch.testing.assert_close(a, b, rtol=6e-4, atol=2e-3, msg=name)


def mamba_by_hand(m: Mamba, x: torch.Tensor) -> torch.Tensor:
    """The mixer written out with explicit loops for the conv (one sequence (L, D))."""
    L = x.shape[0]
    xz = x @ m.in_proj.weight.t()  # (L, 2E)
    xs, z = xz[:, : m.inner], xz[:, m.inner :]
    w = m.conv.weight[:, 0]  # (E, K)
    K = w.shape[1]
    conv = torch.stack(
        [m.conv.bias + sum(w[:, K - 1 - i] * xs[t - i] for i in range(K) if t - i >= 0) for t in range(L)]
    )  # causal: tap K-1 multiplies the current step
    u = F.silu(conv)
    proj = u @ m.x_proj.weight.t()
    dt, B, C = proj[:, : m.dt_rank], proj[:, m.dt_rank : m.dt_rank + m.d_state], proj[:, m.dt_rank + m.d_state :]
    delta = F.softplus(dt @ m.dt_proj.weight.t() + m.dt_proj.bias)
    A = -torch.exp(m.A_log)
    y = selective_scan_reference(u[None], delta[None], A, B[None], C[None], m.D)[0]
    return (y * F.silu(z)) @ m.out_proj.weight.t()


def test_mamba_block_matches_its_definition_and_shapes():
    torch.manual_seed(0)
    m = Mamba(hidden_size=8, d_state=4, d_conv=3, expand=2, scan_chunk=3).double()
    assert m.dt_rank == 1 and m.inner == 16
    torch.testing.assert_close(-torch.exp(m.A_log[5]), -torch.arange(1, 5, dtype=torch.float64))  # S4D-real
    x = torch.randn(2, 7, 8, dtype=torch.float64)
    out = m(x)
    assert out.shape == (2, 7, 8)
    for b in range(2):
        torch.testing.assert_close(out[b].to(torch.float64), mamba_by_hand(m, x[b]), rtol=1e-5, atol=1e-6)


def test_init_like_mamba_ssm_draws_the_step_log_uniformly_and_resets_the_projections():
    torch.manual_seed(0)
    m = Mamba(hidden_size=64)  # E = 128 channels, R = 4
    frozen = {name: p.detach().clone() for name, p in m.named_parameters() if not name.startswith(
        ("in_proj", "x_proj", "out_proj", "dt_proj"))}
    for linear in (m.in_proj, m.x_proj, m.out_proj, m.dt_proj):
        torch.nn.init.normal_(linear.weight, std=0.02)
    torch.nn.init.zeros_(m.dt_proj.bias)
    m.init_like_mamba_ssm_()
    step = F.softplus(m.dt_proj.bias)  # delta where dt_proj's input is 0
    assert step.min() >= 1e-3 * (1 - 1e-5) and step.max() <= 0.1 * (1 + 1e-5)
    logs = torch.log10(step)  # log-uniform on [-3, -1]: every third of the range is drawn from
    for lo in (-3.0, -2 - 1 / 3, -1 - 2 / 3):
        assert ((logs >= lo) & (logs < lo + 2 / 3)).sum() > 128 / 3 / 2
    bound = 4 ** -0.5
    w = m.dt_proj.weight
    assert w.abs().max() <= bound and w.abs().max() > 0.9 * bound
    for linear in (m.in_proj, m.x_proj, m.out_proj):  # PyTorch's default: U(+-1 / sqrt(fan_in))
        fan_in = linear.weight.shape[1]
        assert linear.weight.abs().max() <= fan_in ** -0.5
        assert linear.weight.std() > 0.8 * fan_in ** -0.5 / math.sqrt(3)
    for name, p in m.named_parameters():
        if name in frozen:
            torch.testing.assert_close(p, frozen[name])


def test_mamba_is_causal():
    torch.manual_seed(0)
    m = Mamba(hidden_size=8)
    x = torch.randn(1, 9, 8)
    y = x.clone()
    y[:, 6:] = torch.randn(1, 3, 8)
    torch.testing.assert_close(m(x)[:, :6], m(y)[:, :6])


@pytest.mark.parametrize("bad", [{"d_state": 0}, {"d_conv": -1}, {"expand": 0}, {"scan_chunk": 0}, {"hidden_size": 0}])
def test_mamba_rejects_bad_sizes(bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        Mamba(**{"hidden_size": 8, **bad})


def test_mamba_layer_residual_norm_and_padding_switch():
    torch.manual_seed(0)
    layer = MambaLayer(hidden_size=8, scan_chunk=4).eval()
    masked = MambaLayer(hidden_size=8, scan_chunk=4, mask_padding=True).eval()
    masked.load_state_dict(layer.state_dict())
    mask = torch.tensor([[True] * 6, [True] * 3 + [False] * 3])
    packing = Packing.from_mask(mask, 2, 6, DEVICE)
    x = torch.randn(packing.num_tokens, 8)
    out = layer.forward_packed(x, packing)
    expected = x + layer.norm(packing.pack(layer.mamba(packing.unpack(x))))
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(masked.forward_packed(x, packing), out)  # causal: the switch keeps real tokens


def test_a_zero_init_mamba_layer_starts_as_the_identity_and_learns_its_scale():
    torch.manual_seed(0)
    layer = MambaLayer(hidden_size=8, scan_chunk=4, zero_init=True)
    assert torch.equal(layer.norm.weight, torch.zeros(8)) and torch.equal(layer.norm.bias, torch.zeros(8))
    packing = Packing.from_mask(torch.tensor([[True] * 5, [True] * 2 + [False] * 3]), 2, 5, DEVICE)
    x = torch.randn(packing.num_tokens, 8)
    torch.testing.assert_close(layer.forward_packed(x, packing), x, rtol=0, atol=0)
    target = torch.randn_like(x)
    ((layer.forward_packed(x, packing) - target) ** 2).sum().backward()
    normed = torch.nn.functional.layer_norm(packing.pack(layer.mamba(packing.unpack(x))), (8,))  # (N, D)
    torch.testing.assert_close(layer.norm.weight.grad, (2 * (x - target) * normed).sum(0))  # d/d gamma
    assert layer.norm.weight.grad.abs().min() > 0


def test_the_default_blocking_is_one_tvr_sequence_on_the_cpu_and_the_whole_batch_elsewhere(monkeypatch):
    """TVR's Mamba scan (E = 768, N = 16, chunks of 32): cache-sized blocks of one sequence on the CPU; on
    other devices (here: meta, standing for a GPU) blocks of >= 128 sequences, so a batch of 128 videos
    runs its chunks' steps once instead of once per video (kernel launches, not arithmetic, bound a GPU)."""
    rows_seen = []
    blocks = mamba._blocks
    monkeypatch.setattr(mamba, "_blocks", lambda batch, length, rows, chunk: rows_seen.append(rows) or blocks(batch, length, rows, chunk))
    for device in ("cpu", "meta"):
        x = torch.rand(2, 32, 768, device=device)
        B = C = torch.rand(2, 32, 16, device=device)
        y = selective_scan_chunked(x, x, -torch.ones(768, 16, device=device), B, C, chunk=32)
        assert y.shape == (2, 32, 768) and y.device.type == device
    assert rows_seen[0] == 1 and rows_seen[1] >= 128


@pytest.mark.parametrize("block_elements", [1, 40, 100, 10**9])
def test_every_blocking_gives_the_same_outputs_and_gradients(block_elements):
    """Blocks of one sequence up to all of them (and chunks of 1..9 steps) agree with the recurrence."""
    args = [a.requires_grad_() for a in scan_inputs(batch=3, length=9, channels=5, state=4, seed=11)]
    mask = torch.tensor([[True] * 9, [True] * 4 + [False] * 5, [True] * 7 + [False] * 2])
    weights = torch.randn(3, 9, 5, dtype=torch.float64)
    ref = selective_scan_reference(*args, mask=mask)
    ref_grads = torch.autograd.grad((ref * weights).sum(), args)
    for chunk in (1, 2, 4, 9):
        out = selective_scan_chunked(*args, mask=mask, chunk=chunk, block_elements=block_elements)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
        for a, b in zip(torch.autograd.grad((out * weights).sum(), args), ref_grads):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    with torch.no_grad():
        torch.testing.assert_close(selective_scan_chunked(*args, mask=mask, chunk=4, block_elements=block_elements), ref)


def test_a_bare_mamba_layer_is_the_mixer_alone_and_refuses_zero_init():
    torch.manual_seed(0)
    layer = MambaLayer(hidden_size=8, scan_chunk=4, bare=True)
    assert layer.norm is None and not any("norm" in name for name, _ in layer.named_parameters())
    packing = Packing.from_mask(torch.tensor([[True] * 5, [True] * 2 + [False] * 3]), 2, 5, DEVICE)
    x = torch.randn(packing.num_tokens, 8)
    torch.testing.assert_close(layer.forward_packed(x, packing), packing.pack(layer.mamba(packing.unpack(x))))
    with pytest.raises(ValueError, match="zero_init"):
        MambaLayer(hidden_size=8, zero_init=True, bare=True)
