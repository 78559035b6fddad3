"""The fast attention paths (SDPA for plain branches, float32 windowed products under emulated bf16)
give the plain path's results: per backbone, fp32 to 1e-5 (outputs and gradients), bf16 autocast to a
documented tolerance; and GaussianAttention against a hand loop over branches and heads."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import prvrlab.models.blocks as blocks
import prvrlab.models.gmm as gmm
from prvrlab.models.base import set_activation_checkpointing
from prvrlab.models.blocks import Packing
from prvrlab.models.gmm import GaussianAttention, gaussian_window
from test_backbones import BUILT_IN, NAMES, build, standard_batch
from device_under_test import DEVICE

BACKBONES = NAMES  # every registered backbone: each optimised path must keep its results
FP32_TOL = 1e-5
# bf16 autocast: both paths round to bf16 (8 significant bits, eps 2^-8 ~ 0.004) at different places
# (the fast paths keep the (L, L) products in float32 or inside the fused kernel); a few bf16 ulps
# after the layers: 2e-2 of the tensor's scale (measured: <= 0.01 against the bf16 plain path and
# <= 0.008 against the fp32 one).
BF16_TOL = 2e-2


def assert_close_scaled(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    """max |got - want| <= tol * max(1, max |want|): the tolerance relative to the tensor's scale."""
    scale = max(1.0, float(want.abs().max()))
    error = float((got - want).abs().max())
    assert error <= tol * scale, f"{what}: max error {error:.3g} > {tol} x scale {scale:.3g}"


def floating_tensors(value, name: str):
    """(name, float32 tensor) of every floating tensor inside dataclasses and dicts."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            yield name, value.float()
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from floating_tensors(item, f"{name}.{key}")
    elif dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            yield from floating_tensors(getattr(value, f.name), f"{name}.{f.name}")


def outputs(model, batch, fast: bool, amp: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Every tensor of the model's output and the gradient of their sum w.r.t. every parameter."""
    GaussianAttention.fast = fast
    try:
        model.zero_grad(set_to_none=True)
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=amp):
            out = model(batch)
        tensors = dict(floating_tensors(out, "out"))
        sum(t.sum() for t in tensors.values()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return {k: v.detach() for k, v in tensors.items()}, grads
    finally:
        GaussianAttention.fast = True


@pytest.mark.parametrize("name", BACKBONES)
def test_fast_equals_plain_fp32(name):
    torch.manual_seed(0)
    model = build(name).train()
    batch = standard_batch()  # variable lengths: padding keys masked
    torch.manual_seed(1)
    plain, plain_grads = outputs(model, batch, fast=False)
    torch.manual_seed(1)
    fast, fast_grads = outputs(model, batch, fast=True)
    assert plain.keys() == fast.keys() and plain
    for key in plain:
        assert_close_scaled(fast[key], plain[key], FP32_TOL, key)
    assert plain_grads.keys() == fast_grads.keys()
    for key in plain_grads:
        assert_close_scaled(fast_grads[key], plain_grads[key], FP32_TOL, f"grad of {key}")


@pytest.mark.parametrize("name", BACKBONES)
def test_fast_bf16_within_tolerance(name):
    torch.manual_seed(0)
    model = build(name).eval()
    batch = standard_batch()
    plain, _ = outputs(model, batch, fast=False, amp=True)
    fast, _ = outputs(model, batch, fast=True, amp=True)
    exact, _ = outputs(model, batch, fast=False)
    for key in plain:
        assert_close_scaled(fast[key], plain[key], BF16_TOL, key)
        assert_close_scaled(fast[key], exact[key], BF16_TOL, key)


def saved_bytes(model, batch) -> int:
    """Bytes of the tensors autograd saves for the backward of one forward (storages counted once)."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(batch)
    return sum(storages.values())


@pytest.mark.parametrize("fast", [False, True], ids=["plain", "fast"])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_checkpointed_branches_equal_one_pass_fp32(dropout, fast):
    """train.checkpoint_activations (gmmformer_v2's TC-GMMBlocks, branch by branch) gives the one-pass
    outputs and gradients, dropout masks included, and saves far fewer bytes for the backward."""
    if dropout and DEVICE.type == "cuda":
        pytest.skip("dropout masks drawn branch by branch equal the one-pass masks with the CPU generator only; "
                    "on an H200 (2026-11-27) the scores differed by up to 4e-4 (CUDA's Philox offsets per call)")
    torch.manual_seed(0)
    model = build("gmmformer_v2", dropout=dropout, attention_dropout=dropout).train()
    batch = standard_batch()
    torch.manual_seed(1)
    plain, plain_grads = outputs(model, batch, fast=fast)
    plain_saved = saved_bytes(model, batch)
    assert set_activation_checkpointing(model, True) == 5  # 2 TC-GMMBlocks, 3 input projections
    torch.manual_seed(1)
    ckpt, ckpt_grads = outputs(model, batch, fast=fast)
    assert plain.keys() == ckpt.keys() and plain_grads.keys() == ckpt_grads.keys()
    for key in plain:
        assert_close_scaled(ckpt[key], plain[key], FP32_TOL, key)
    for key in plain_grads:
        assert_close_scaled(ckpt_grads[key], plain_grads[key], FP32_TOL, f"grad of {key}")
    assert saved_bytes(model, batch) < 0.6 * plain_saved
    torch.manual_seed(2)  # another draw: the outputs move when dropout is on (the comparison above can fail)
    other, _ = outputs(model, batch, fast=fast)
    moved = max(float((other[k] - ckpt[k]).abs().max()) for k in ckpt)
    assert (moved > 1e-3) == (dropout > 0)


@pytest.mark.parametrize("name", BACKBONES)
def test_checkpointed_input_projections_equal_one_pass_fp32(name):
    """Every backbone's input projections under train.checkpoint_activations (recomputed in the
    backward with the RNG state restored) give the one-pass outputs and gradients, dropout included."""
    torch.manual_seed(0)
    model = build(name, dropout=0.3).train()
    batch = standard_batch()
    torch.manual_seed(1)
    plain, plain_grads = outputs(model, batch, fast=True)
    switched = set_activation_checkpointing(model, True)
    if switched == 0 and name not in BUILT_IN:
        pytest.skip(f"{name} has no checkpointable parts (train.checkpoint_activations changes nothing)")
    assert switched >= 2
    torch.manual_seed(1)
    ckpt, ckpt_grads = outputs(model, batch, fast=True)
    assert plain.keys() == ckpt.keys() and plain_grads.keys() == ckpt_grads.keys()
    for key in plain:
        assert_close_scaled(ckpt[key], plain[key], FP32_TOL, key)
    for key in plain_grads:
        assert_close_scaled(ckpt_grads[key], plain_grads[key], FP32_TOL, f"grad of {key}")


def hand_attention(att: GaussianAttention, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Branch by branch, head by head, sequence by sequence on its real tokens: (K, B, L, D), zeros on padding."""
    K, H, Dh, D = att.num_branches, att.num_heads, att.head_dim, att.hidden_size
    B, L, _ = x.shape
    out = torch.zeros(K, B, L, D)
    qkv = x @ att.qkv.weight.T + att.qkv.bias  # (B, L, 3*K*D)
    for b, n in enumerate(lengths):
        for k, sigma in enumerate(att.sigmas):
            window = gaussian_window(L, sigma, window=att.window, device=x.device) if math.isfinite(sigma) else torch.ones(L, L)
            heads = []
            for h in range(H):
                cols = [(part * K + k) * D + h * Dh + i for part in range(3) for i in range(Dh)]
                q, kk, v = qkv[b, :n, cols].split(Dh, dim=-1)  # (n, Dh) each
                logits = window[:n, :n] * (q @ kk.T) / math.sqrt(Dh)
                heads.append(torch.softmax(logits, dim=-1) @ v)  # (n, Dh)
            ctx = torch.cat(heads, dim=-1)  # (n, D)
            out[k, b, :n] = ctx @ att.out.weight[k].T + att.out.bias[k]
    return out


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
def test_fast_attention_matches_hand_loop_mixed_branch_order(amp):
    """fp32: one explicit pass over all branches; bf16: plain branches on SDPA, windowed ones apart,
    put back in branch order."""
    torch.manual_seed(0)
    att = GaussianAttention(hidden_size=8, num_heads=2, sigmas=["inf", 0.5, "inf", 1.0])
    with torch.no_grad():  # outputs of order 1, so that the bf16 tolerance is tight
        for weight in (att.qkv.weight, att.out.weight):
            weight.normal_(0.0, 0.5)
    lengths = [5, 2, 7]
    x = torch.randn(3, 7, 8)
    mask = torch.arange(7)[None] < torch.tensor(lengths)[:, None]
    with torch.no_grad():
        expected = hand_attention(att, x, lengths)
    with torch.no_grad(), torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=amp):
        got = att(x, mask).float()
    assert_close_scaled(got, expected, BF16_TOL if amp else FP32_TOL, "attention")
    swapped = expected[[2, 1, 0, 3]]  # branches 0 and 2 (both plain) swapped: far outside the tolerance
    assert float((swapped - expected).abs().max()) > 10 * BF16_TOL * max(1.0, float(expected.abs().max()))


def test_windowed_products_run_in_float32_without_native_bf16(monkeypatch):
    """On a CPU without native bf16 the windowed (L, L) products are float32: the result equals the
    float32 computation of the same bf16 inputs, not the bf16 one."""
    monkeypatch.setattr(gmm, "native_low_precision", lambda device_type: False)
    torch.manual_seed(0)
    att = GaussianAttention(hidden_size=8, num_heads=2, sigmas=[0.5, 1.0])
    B, L = 2, 6
    packing = Packing.full(B, L, DEVICE)
    q, k, v = (torch.randn(B, 2, 2, L, 4).bfloat16() for _ in range(3))
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        got = att._attend_windowed(q, k, v, packing, att.sigmas)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, att._attend(q.float(), k.float(), v.float(), packing, att.sigmas))
    monkeypatch.setattr(gmm, "native_low_precision", lambda device_type: True)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        assert att._attend_windowed(q, k, v, packing, att.sigmas).dtype == torch.bfloat16


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
def test_inference_projects_mostly_real_batches_on_the_padded_layout(monkeypatch, amp):
    """At inference, a batch with at most a quarter of its slots padded computes Q/K/V before
    unpacking; outputs equal the hand loop and the packed projection's, and training never does."""
    torch.manual_seed(0)
    att = GaussianAttention(hidden_size=8, num_heads=2, sigmas=["inf", 0.5, 1.0]).eval()
    with torch.no_grad():
        for weight in (att.qkv.weight, att.out.weight):
            weight.normal_(0.0, 0.5)
    lengths = [7, 6, 7]  # 1 of 21 slots padded
    x = torch.randn(3, 7, 8)
    mask = torch.arange(7)[None] < torch.tensor(lengths)[:, None]
    taken = spy_padded_first(monkeypatch)
    with torch.no_grad():
        expected = hand_attention(att, x, lengths)
    with torch.no_grad(), torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=amp):
        padded = att(x, mask).float()
        monkeypatch.setattr(blocks, "PADDED_FIRST_MAX", -1.0)  # never
        packed = att(x, mask).float()
    assert taken == [True, False]
    tol = BF16_TOL if amp else FP32_TOL
    assert_close_scaled(padded, expected, tol, "padded projection")
    assert_close_scaled(padded, packed, tol, "padded vs packed projection")
    assert (padded[:, 1, 6] == 0).all()  # the padding's outputs stay zero
    monkeypatch.setattr(blocks, "PADDED_FIRST_MAX", 0.25)
    calls = len(taken)
    att(x, mask).sum().backward()  # autograd: the packed projection
    assert taken[calls:] == [False]
    with torch.no_grad():  # a third of the slots padded: packed
        att(x, torch.arange(7)[None] < torch.tensor([5, 2, 7])[:, None])
    assert taken[-1] is False
    att.train()
    with torch.no_grad():  # training mode without autograd (a plug-in's no-grad pass): not even asked
        att(x, mask)
    assert len(taken) == calls + 2


def spy_padded_first(monkeypatch) -> list[bool]:
    """Record every answer of Packing.padded_first."""
    taken: list[bool] = []
    decide = Packing.padded_first
    monkeypatch.setattr(Packing, "padded_first", lambda self: taken.append(decide(self)) or taken[-1])
    return taken


@pytest.mark.parametrize("name", BACKBONES)
def test_inference_input_projection_of_mostly_real_batches_runs_padded(monkeypatch, name):
    """Every backbone's video encoding at inference, with 1 of 16 frame slots padded: the input
    projections run on the padded layout, and the embeddings equal the packed path's (fp32, 1e-5)."""
    torch.manual_seed(0)
    model = build(name).eval()
    if name not in BUILT_IN and not any(isinstance(m, blocks.InputProjection) for m in model.modules()):
        pytest.skip(f"{name} has no InputProjection")
    batch = standard_batch()
    B, L = batch.frame_mask.shape
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[0, L - 1] = False  # one padded slot
    frames = batch.frames * mask[..., None]
    taken = spy_padded_first(monkeypatch)
    with torch.no_grad():
        padded = dict(floating_tensors(model.encode_videos(batch.clips, frames, mask), "video"))
        assert any(taken)
        monkeypatch.setattr(blocks, "PADDED_FIRST_MAX", -1.0)  # never
        packed = dict(floating_tensors(model.encode_videos(batch.clips, frames, mask), "video"))
    assert padded.keys() == packed.keys() and padded
    for key in padded:
        assert_close_scaled(padded[key], packed[key], FP32_TOL, key)


def hand_branch_mlp(x, first, second, branches):
    """The branch MLP as written: a loop over branches of x @ W.T + b, ReLU, x @ W.T + b (float64)."""
    outs = []
    for k in range(first.weight.shape[0])[branches]:
        h = x[len(outs)].double() @ first.weight[k].double().T + first.bias[k].double()
        if second is not None:
            h = torch.relu(h) @ second.weight[k].double().T + second.bias[k].double()
        outs.append(h)
    return torch.stack(outs)


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_second", [False, True], ids=["linear", "mlp"])
@pytest.mark.parametrize("fused", [True, False], ids=["onednn-relu", "plain-relu"])
def test_branch_mlp_inference_equals_batched_autograd_path(monkeypatch, amp, with_second, fused):
    """BranchLinear / branch_mlp at inference (one GEMM per branch, bias inside it, ReLU fused by oneDNN
    where built in) give the batched autograd path's values and dtype, for all branches and for a slice."""
    torch.manual_seed(0)
    first = blocks.BranchLinear(num_branches=4, in_dim=6, out_dim=10)
    second = blocks.BranchLinear(num_branches=4, in_dim=10, out_dim=6) if with_second else None
    with torch.no_grad():
        for layer in (first, second):
            if layer is not None:
                layer.weight.normal_(0.0, 0.5)
                layer.bias.normal_(0.0, 0.5)
    real = blocks._fused_linear  # the op where this torch and CPU run it (an AVX2-only CPU: not in bf16)
    monkeypatch.setattr(blocks, "_fused_linear", lambda dtype: fused and real(dtype))
    for branches in (slice(None), slice(1, 3)):
        x = torch.randn(4 if branches == slice(None) else 2, 9, 6)
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=amp):
            batched = blocks.branch_mlp(x, first, second, branches)  # autograd on: batched GEMMs
            with torch.no_grad():
                per_branch = blocks.branch_mlp(x, first, second, branches)
                forward = first(x, branches) if second is None else None
        assert per_branch.dtype == batched.dtype == (torch.bfloat16 if amp else torch.float32)
        tol = BF16_TOL if amp else FP32_TOL
        assert_close_scaled(per_branch.float(), batched.detach().float(), tol, "per branch vs batched")
        with torch.no_grad():
            hand = hand_branch_mlp(x, first, second, branches)
        assert_close_scaled(per_branch.double(), hand, tol, "per branch vs hand loop")
        if forward is not None:
            assert torch.equal(forward, per_branch)


def expected_sdpa(mixed: bool, dtype: torch.dtype, grad: bool, native: bool, contiguous: bool, fused: bool) -> bool:
    """gmm._one_pass's table, written out: whether plain branches go to SDPA."""
    if fused and DEVICE.type == "cpu" and (dtype == torch.float32 or native):
        return False  # the fused weights' explicit pass beats SDPA wherever they run
    if dtype == torch.float32:
        return not mixed  # float32: mixed branches in one pass, plain-only layers on SDPA
    if DEVICE.type != "cpu" or not native:
        return True  # other devices, emulated bf16: SDPA
    if grad:
        return False  # bf16 with autograd on native units: the explicit pass (SDPA's CPU backward is slow)
    return not (mixed and contiguous)  # inference: mixed branches from the contiguous head layout in one pass


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("contiguous", [True, False], ids=["head-layout", "strided"])
@pytest.mark.parametrize("native", [True, False], ids=["native", "emulated"])
@pytest.mark.parametrize("grad", [True, False], ids=["autograd", "inference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("sigmas", [[0.5, "inf", 1.0], ["inf", "inf"]], ids=["mixed", "plain"])
def test_plain_branches_go_to_sdpa_only_where_measured_faster(monkeypatch, sigmas, dtype, grad, native, contiguous, fused):
    """Plain branches go to SDPA or into the explicit pass as measured (gmm._one_pass), with and without
    the fused weights; either way the result equals the one explicit pass."""
    monkeypatch.setattr(gmm, "native_low_precision", lambda device_type: native)
    monkeypatch.setattr(GaussianAttention, "fused", fused)
    fused = fused and gmm.window_softmax.load() is not None
    sdpa_calls: list[int] = []
    attend_sdpa = GaussianAttention._attend_sdpa
    monkeypatch.setattr(GaussianAttention, "_attend_sdpa", lambda self, *a: sdpa_calls.append(1) or attend_sdpa(self, *a))
    torch.manual_seed(0)
    att = GaussianAttention(hidden_size=8, num_heads=2, sigmas=sigmas)
    B, S, L = 2, len(sigmas), 6
    packing = Packing.full(B, L, DEVICE)
    if contiguous:
        q, k, v = (torch.randn(B, S, 2, L, 4, device=DEVICE).to(dtype) for _ in range(3))
    else:  # the padded layout's strided views (B, L, S, H, Dh) -> (B, S, H, L, Dh)
        q, k, v = (torch.randn(B, L, S, 2, 4, device=DEVICE).to(dtype).permute(0, 2, 3, 1, 4) for _ in range(3))
    assert q.is_contiguous() == contiguous
    with torch.set_grad_enabled(grad):
        got = att._attend_fast(q, k, v, packing, att.sigmas)
    assert bool(sdpa_calls) == expected_sdpa(len(set(sigmas)) > 1, dtype, grad, native, contiguous, fused)
    with torch.autocast(DEVICE.type, enabled=False):
        want = att._attend(q.float(), k.float(), v.float(), packing, att.sigmas)
    assert_close_scaled(got.float().detach(), want.detach(), BF16_TOL if dtype == torch.bfloat16 else FP32_TOL, "fast")


@pytest.mark.parametrize("lengths", [[5, 2, 5], [5, 5, 5]], ids=["padded", "full"])
def test_head_layout_equals_unpack_and_permute_with_gradients(lengths):
    """gmm._HeadLayout: the packed (N, 3, G, Dh) projection laid out as contiguous q, k, v (B, G, L, Dh)
    equals unpacking and permuting (zeros on padding), and its backward gives the same gradient."""
    torch.manual_seed(0)
    B, L, G, Dh = len(lengths), 5, 4, 3
    mask = torch.arange(L)[None] < torch.tensor(lengths)[:, None]
    packing = Packing.from_mask(mask, B, L, DEVICE)
    projected = torch.randn(packing.num_tokens, 3, G, Dh, device=DEVICE, dtype=torch.float64, requires_grad=True)
    rows, positions = (None, None) if packing.index is None else (packing.rows(), packing.positions)
    heads = gmm._HeadLayout.apply(projected, rows, positions, B, L)
    want = [t.permute(0, 2, 1, 3) for t in packing.unpack(projected).unbind(2)]  # (B, G, L, Dh) each
    probes = [torch.randn_like(w) for w in want]
    for got, expected in zip(heads, want):
        assert got.is_contiguous()
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    for used in ([0, 1, 2], [0, 2]):  # a part with no gradient counts as zeros
        grad = torch.autograd.grad(sum((heads[i] * probes[i]).sum() for i in used), projected, retain_graph=True)[0]
        expected = torch.autograd.grad(sum((want[i] * probes[i]).sum() for i in used), projected, retain_graph=True)[0]
        torch.testing.assert_close(grad, expected, rtol=0, atol=0)


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_second", [False, True], ids=["linear", "mlp"])
@pytest.mark.parametrize("input_grad", [True, False], ids=["input-grad", "no-input-grad"])
def test_branch_mlp_autograd_equals_hand_loop(amp, with_second, input_grad):
    """branch_mlp with autograd (per-branch GEMMs forward and backward on CPU, batched elsewhere): output
    and the gradients of the input, weights and biases equal float64 autograd through the hand loop,
    for all branches and for a slice; ReLU units at zero get no gradient."""
    torch.manual_seed(1)
    first = blocks.BranchLinear(num_branches=4, in_dim=6, out_dim=10).to(DEVICE)
    second = blocks.BranchLinear(num_branches=4, in_dim=10, out_dim=6).to(DEVICE) if with_second else None
    layers = [layer for layer in (first, second) if layer is not None]
    with torch.no_grad():
        for layer in layers:
            layer.weight.normal_(0.0, 0.5)
            layer.bias.normal_(0.0, 0.5)
    params = [p for layer in layers for p in (layer.weight, layer.bias)]
    tol = BF16_TOL if amp else FP32_TOL
    for branches in (slice(None), slice(1, 3)):
        x = torch.randn(4 if branches == slice(None) else 2, 9, 6, device=DEVICE, requires_grad=input_grad)
        g = torch.randn(x.shape[0], 9, 6 if with_second else 10, device=DEVICE)
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=amp):
            y = blocks.branch_mlp(x, first, second, branches)
        assert y.dtype == (torch.bfloat16 if amp else torch.float32)
        got = torch.autograd.grad(y, ([x] if input_grad else []) + params, g)
        hand = hand_branch_mlp(x.double() if input_grad else x, first, second, branches)
        want = torch.autograd.grad(hand, ([x] if input_grad else []) + params, g.double())
        assert_close_scaled(y.detach().double(), hand.detach(), tol, "output")
        names = (["x"] if input_grad else []) + [f"{kind}{i}" for i in range(len(layers)) for kind in ("weight", "bias")]
        for name, a, b in zip(names, got, want):
            assert_close_scaled(a.double(), b.double(), tol, name)
        if with_second and branches == slice(None):
            pre = x.detach().double() @ first.weight.detach().double().transpose(1, 2) + first.bias.detach().double()[:, None]
            assert (pre < 0).any() and (pre > 0).any()  # both sides of the ReLU are exercised


@pytest.mark.parametrize("lengths", [[5, 2, 5], [5, 5, 5], [3, 0, 1]], ids=["padded", "full", "empty-video"])
def test_merge_heads_equals_permute_and_pack_with_gradients(lengths):
    """gmm._MergeHeads: attention outputs (B, k, H, L, Dh) as packed rows (k, N, H*Dh) equal permuting to
    (k, B, L, H*Dh) and keeping the real tokens; the gradient is the probe's rows on real slots and zeros on
    padding, in the contiguous (B, k, H, L, Dh) layout."""
    torch.manual_seed(0)
    B, K, H, L, Dh = len(lengths), 2, 3, 5, 4
    mask = torch.arange(L)[None] < torch.tensor(lengths)[:, None]
    packing = Packing.from_mask(mask, B, L, DEVICE)
    heads = torch.randn(B, K, H, L, Dh, device=DEVICE, dtype=torch.float64, requires_grad=True)
    rows, positions = (None, None) if packing.index is None else (packing.rows(), packing.positions)
    got = gmm._MergeHeads.apply(heads, rows, positions)
    slots = heads.permute(1, 0, 3, 2, 4).reshape(K, B, L, H * Dh)  # (k, B, L, D)
    want = torch.stack([slots[:, b, t] for b in range(B) for t in range(lengths[b])], dim=1)  # (k, N, D)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    probe = torch.randn_like(want)
    (grad,) = torch.autograd.grad((got * probe).sum(), heads)
    assert grad.is_contiguous()
    expected = torch.zeros(K, B, L, H, Dh, dtype=torch.float64, device=DEVICE)
    n = 0
    for b in range(B):
        for t in range(lengths[b]):
            expected[:, b, t] = probe[:, n].view(K, H, Dh)
            n += 1
    torch.testing.assert_close(grad, expected.permute(1, 0, 3, 2, 4), rtol=0, atol=0)


@pytest.mark.parametrize("with_second", [False, True], ids=["linear", "mlp"])
def test_batched_branch_gemms_equal_per_branch_ones(with_second):
    """The batched form branch_mlp takes with autograd off the CPU (blocks._batched_mlp) gives the per-branch
    Function's output and gradients (both run here on the CPU, float64)."""
    torch.manual_seed(3)
    k, n, d, h = 3, 7, 5, 6
    x = torch.randn(k, n, d, dtype=torch.float64, requires_grad=True)
    params = [torch.randn(k, h, d, dtype=torch.float64), torch.randn(k, h, dtype=torch.float64)]
    if with_second:
        params += [torch.randn(k, 4, h, dtype=torch.float64), torch.randn(k, 4, dtype=torch.float64)]
    params = [p.requires_grad_() for p in params]
    per_branch = blocks._BranchGemms.apply(x, *params)
    batched = blocks._batched_mlp(x, *params)
    torch.testing.assert_close(batched, per_branch)
    probe = torch.randn_like(batched)
    for a, b in zip(torch.autograd.grad(batched, [x, *params], probe), torch.autograd.grad(per_branch, [x, *params], probe)):
        torch.testing.assert_close(a, b)


@pytest.mark.skipif(not blocks._fused_linear(torch.bfloat16), reason="no oneDNN fused bf16 linear in this torch or on this CPU")
def test_project_adds_the_bias_inside_the_gemm_with_the_same_values(monkeypatch):
    """blocks.project in bf16 equals the module call bit for bit (bf16 operands, float32 sums plus the
    bias, one rounding), at inference and with autograd; it falls back to the module elsewhere."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 96)
    with torch.no_grad():
        layer.bias.normal_(0.0, 3.0)  # a bias that shows if it were dropped or added twice
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(blocks.torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(a) or real(*a))
    x32, x16 = torch.randn(2, 37, 48), torch.randn(70, 48).bfloat16()
    with torch.inference_mode():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = layer(x32)
            got = blocks.project(layer, x32)  # float32 input under autocast
        assert got.dtype == want.dtype == torch.bfloat16 and torch.equal(got, want)
        assert torch.equal(blocks.project(layer.bfloat16(), x16), layer(x16)) and len(calls) == 2
        layer.float()
        assert torch.equal(blocks.project(layer, x32), layer(x32))  # float32: the module (MKL's GEMM)
        strided = x32.transpose(0, 1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(blocks.project(layer, strided), layer(strided))  # not contiguous: the module
    with torch.autocast("cpu", dtype=torch.bfloat16):
        trained = blocks.project(layer, x32)  # autograd on: one fused call too, with a graph (_BiasLinear)
        assert torch.equal(trained, layer(x32))
    assert trained.requires_grad and len(calls) == 3


@pytest.mark.skipif(not blocks._fused_linear(torch.bfloat16), reason="no oneDNN fused bf16 linear in this torch or on this CPU")
def test_project_in_parts_gives_the_column_blocks_of_the_module_call(monkeypatch):
    """blocks.project(layer, x, parts): ``parts`` contiguous outputs equal to the column blocks of the
    module's output, bit for bit, by one oneDNN call each at bf16 inference; views of the module's
    output elsewhere (float32, autograd, a width that ``parts`` does not divide)."""
    torch.manual_seed(2)
    layer = torch.nn.Linear(40, 96)
    with torch.no_grad():
        layer.bias.normal_(0.0, 3.0)
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(blocks.torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(a[1].shape) or real(*a))
    x = torch.randn(3, 11, 40)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        whole = layer(x)  # (3, 11, 96)
        got = blocks.project(layer, x, 3)
    assert calls == [(32, 40)] * 3 and all(t.is_contiguous() and t.shape == (3, 11, 32) for t in got)
    for i, part in enumerate(got):
        assert torch.equal(part, whole[..., 32 * i : 32 * (i + 1)])
    with torch.inference_mode():
        plain = blocks.project(layer, x, 3)  # float32: views of the module's output
        assert all(torch.equal(p, w) for p, w in zip(plain, layer(x).chunk(3, -1)))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            odd = blocks.project(layer, x, 5)  # 96 is not a multiple of 5: the module's chunks
            assert [t.shape[-1] for t in odd] == [20, 20, 20, 20, 16] and torch.equal(torch.cat(odd, -1), whole)
    assert len(calls) == 3


@pytest.mark.parametrize("sigmas", [["inf", 0.5, 1.0], [0.5, 1.0, 3.0, 5.0]])
def test_attention_inference_is_unchanged_by_the_fused_bias(monkeypatch, sigmas):
    """GaussianAttention's Q/K/V through blocks.project: the same bf16 outputs as the plain module call,
    on a padded batch (packed path) and on a barely padded one (the padded-first path)."""
    torch.manual_seed(1)
    att = GaussianAttention(hidden_size=16, num_heads=2, sigmas=sigmas).eval()
    real = blocks._fused_linear
    for lengths in ([9, 3, 6], [9, 9, 8]):
        mask = torch.arange(9)[None, :] < torch.tensor(lengths)[:, None]  # (B, L)
        x = torch.randn(len(lengths), 9, 16)
        outs = []
        for fused in (True, False):
            monkeypatch.setattr(blocks, "_fused_linear", lambda dtype, fused=fused: fused and real(dtype))
            with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
                outs.append(att(x, mask))
        assert torch.equal(outs[0], outs[1])


@pytest.mark.skipif(not blocks.torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")
def test_without_onednn_bf16_the_fused_linear_is_left_to_float32(monkeypatch):
    """A CPU where oneDNN creates no bf16 primitive (AVX2 only: 'could not create a primitive descriptor
    for the inner product') takes F.linear, ATen's own bf16 GEMM, in every bf16 path: projections,
    branch FFNs and a whole backbone's bf16 inference; float32 products keep the fused op."""
    real = torch.ops.mkldnn._linear_pointwise
    dtypes = []

    def avx2_only(x, *args):
        dtypes.append(x.dtype)
        if x.dtype == torch.bfloat16:
            raise RuntimeError("could not create a primitive descriptor for the inner product forward propagation primitive")
        return real(x, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", avx2_only)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False, raising=False)
    blocks._fused_linear.cache_clear()
    try:
        assert not blocks._fused_linear(torch.bfloat16) and blocks._fused_linear(torch.float32)
        torch.manual_seed(0)
        layer = torch.nn.Linear(12, 24)
        first = blocks.BranchLinear(num_branches=3, in_dim=12, out_dim=20)
        second = blocks.BranchLinear(num_branches=3, in_dim=20, out_dim=12)
        x = torch.randn(3, 7, 12)
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(blocks.project(layer, x[0], 3)[1], layer(x[0]).chunk(3, -1)[1])
            mlp = blocks.branch_mlp(x, first, second)  # (3, 7, 12)
        for k in range(3):
            with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
                h = torch.relu(torch.nn.functional.linear(x[k], first.weight[k], first.bias[k]))  # (7, 20)
                want = torch.nn.functional.linear(h, second.weight[k], second.bias[k])  # (7, 12)
            torch.testing.assert_close(mlp[k], want, atol=0, rtol=0)
        with torch.inference_mode():
            blocks.branch_mlp(x, first, second)  # float32: the fused op
        assert dtypes and set(dtypes) == {torch.float32}
        model = build("gmmformer_v2").eval()
        batch = standard_batch()
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            video = model.encode_videos(batch.clips, batch.frames, batch.frame_mask)
        assert torch.isfinite(video.frame.float()).all() and set(dtypes) == {torch.float32}
    finally:
        blocks._fused_linear.cache_clear()


# GMMFormer v2's official layers (checkpoint format 8): dropout inside the FFNs, no output projections, one
# weight token, dropout on the cross-attention's probabilities; and the switches' old values.
V2_OLD = {"attention_output": "projected", "query_activation": "gelu", "ffn_dropout": False,
          "cross_attention_dropout": False, "weight_token": "per_block"}


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("path", ["per-branch", "batched", "inference"])
def test_branch_mlp_with_inner_dropout_equals_hand_loop(amp, path, monkeypatch):
    """branch_mlp with a dropout draw after the ReLU (ffn_dropout): the per-branch Function (CPU autograd;
    its backward reads the dropped ReLU output only), the batched autograd form (other devices) and the
    inference loop all equal ``(relu(x W1 + b1) * mask) W2 + b2`` through float64 autograd, with the same
    mask, for all branches and a slice; the draw really drops units."""
    if path == "per-branch" and DEVICE.type != "cpu":
        pytest.skip("the per-branch Function is the CPU's autograd path")
    if path == "batched":  # what branch_mlp takes with autograd off the CPU
        monkeypatch.setattr(blocks, "_BranchGemms", type("Batched", (), {"apply": staticmethod(
            lambda x, w1, b1, w2, b2, draw, p: blocks._batched_mlp(x, w1, b1, w2, b2, draw=draw, p=p))}))
    torch.manual_seed(4)
    p = 0.3
    first = blocks.BranchLinear(num_branches=4, in_dim=6, out_dim=10).to(DEVICE)
    second = blocks.BranchLinear(num_branches=4, in_dim=10, out_dim=6).to(DEVICE)
    with torch.no_grad():
        for layer in (first, second):
            layer.weight.normal_(0.0, 0.5)
            layer.bias.normal_(0.0, 0.5)
    params = [first.weight, first.bias, second.weight, second.bias]
    tol = BF16_TOL if amp else FP32_TOL
    for branches in (slice(None), slice(1, 3)):
        k = 4 if branches == slice(None) else 2
        x = torch.randn(k, 9, 6, device=DEVICE, requires_grad=path != "inference")
        draw = blocks.dropout_draw((k, 9, 10), p, x.device)
        mask = blocks.mask_from_draw(draw, p, torch.float64)  # (k, N, hidden)
        assert (mask == 0).any() and (mask > 0).any()
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=amp), torch.set_grad_enabled(path != "inference"):
            y = blocks.branch_mlp(x, first, second, branches, draw, p)
        outs = []
        for j, b in enumerate(range(4)[branches]):
            h = torch.relu(x[j].double() @ first.weight[b].double().T + first.bias[b].double()) * mask[j]
            outs.append(h @ second.weight[b].double().T + second.bias[b].double())
        hand = torch.stack(outs)
        assert_close_scaled(y.detach().double(), hand.detach(), tol, "output")
        if path == "inference":
            continue
        g = torch.randn(k, 9, 6, device=DEVICE)
        got = torch.autograd.grad(y, [x] + params, g)
        want = torch.autograd.grad(hand, [x] + params, g.double())
        for name, a, b in zip(["x", "w1", "b1", "w2", "b2"], got, want):
            assert_close_scaled(a.double(), b.double(), tol, name)


@pytest.mark.parametrize("switches", ["official", "old"])
def test_v2_fast_equals_plain_with_every_dropout_fp32(switches):
    """gmmformer_v2 in training with dropout and attention dropout on (the official layers draw inside the
    FFNs and on the cross-attention's probabilities too): the fast attention paths give the plain path's
    outputs and gradients under both the official layers and the switches' old values."""
    torch.manual_seed(0)
    model = build("gmmformer_v2", dropout=0.2, attention_dropout=0.2, **({} if switches == "official" else V2_OLD)).train()
    batch = standard_batch()
    torch.manual_seed(1)
    plain, plain_grads = outputs(model, batch, fast=False)
    torch.manual_seed(1)
    fast, fast_grads = outputs(model, batch, fast=True)
    assert plain.keys() == fast.keys() and plain_grads.keys() == fast_grads.keys()
    for key in plain:
        assert_close_scaled(fast[key], plain[key], FP32_TOL, key)
    for key in plain_grads:
        assert_close_scaled(fast_grads[key], plain_grads[key], FP32_TOL, f"grad of {key}")


@pytest.mark.parametrize("switches", ["official", "old"])
def test_v2_checkpointed_branches_equal_one_pass_with_ffn_dropout(switches):
    """train.checkpoint_activations with the official FFN dropout (a third, (K, N, F) draw taken with the two
    residual ones) and without it: the branch-by-branch recomputation gives the one-pass run's outputs and
    gradients."""
    if DEVICE.type == "cuda":
        pytest.skip("dropout masks drawn branch by branch equal the one-pass masks with the CPU generator only")
    torch.manual_seed(0)
    model = build("gmmformer_v2", dropout=0.3, attention_dropout=0.3, **({} if switches == "official" else V2_OLD)).train()
    batch = standard_batch()
    torch.manual_seed(1)
    one, one_grads = outputs(model, batch, fast=True)
    set_activation_checkpointing(model, True)
    torch.manual_seed(1)
    ckpt, ckpt_grads = outputs(model, batch, fast=True)
    for key in one:
        assert_close_scaled(ckpt[key], one[key], FP32_TOL, key)
    for key in one_grads:
        assert_close_scaled(ckpt_grads[key], one_grads[key], FP32_TOL, f"grad of {key}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_scores_product_gives_autograds_gradients_with_a_contiguous_key_gradient(dtype):
    """gmm._Scores: q kᵀ and its gradients against a float64 hand sum, the key gradient contiguous (autograd's
    matmul gives a transposed view of qᵀ dS there)."""
    gen = torch.Generator().manual_seed(4)
    q64, k64 = torch.randn(2, 3, 7, 5, generator=gen, dtype=torch.float64), torch.randn(2, 3, 7, 5, generator=gen, dtype=torch.float64)
    g64 = torch.randn(2, 3, 7, 7, generator=gen, dtype=torch.float64)
    q, k, g = (t.to(dtype) for t in (q64, k64, g64))
    q.requires_grad_(), k.requires_grad_()
    arriving = []  # the key gradient as the product hands it over (a leaf's .grad is made contiguous anyway)
    k.register_hook(lambda grad: arriving.append(grad.is_contiguous()))
    scores = gmm._Scores.apply(q, k)
    scores.backward(g)
    qd, kd, gd = (t.double() for t in (q.detach(), k.detach(), g))  # the stored values, summed in float64
    want_s = torch.einsum("bhid,bhjd->bhij", qd, kd)
    want_dq = torch.einsum("bhij,bhjd->bhid", gd, kd)
    want_dk = torch.einsum("bhij,bhid->bhjd", gd, qd)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2**-7}[dtype]  # bf16: one rounding of the result
    for got, want in ((scores.detach(), want_s), (q.grad, want_dq), (k.grad, want_dk)):
        assert got.dtype == dtype
        assert_close_scaled(got.double(), want, tol, "scores")
    assert arriving == [True]


def test_the_fused_path_hands_the_head_layout_contiguous_key_gradients(monkeypatch):
    """The fused windowed path on CPU computes its logits with gmm._Scores, so _HeadLayout's backward gets
    three contiguous gradients (no whole copy before its gather); the plain path keeps autograd's matmul."""
    seen = []
    backward = gmm._HeadLayout.backward

    def spy(ctx, *grads):
        seen.append([g.is_contiguous() for g in grads])
        return backward(ctx, *grads)

    monkeypatch.setattr(gmm._HeadLayout, "backward", staticmethod(spy))
    attention = GaussianAttention(hidden_size=16, num_heads=2, sigmas=(0.3, 1.0))
    packing = Packing.from_mask(torch.arange(6)[None] < torch.tensor([[6], [4]]), 2, 6, "cpu")
    x = torch.randn(packing.num_tokens, 16, requires_grad=True)
    attention.forward_packed(x, packing).sum().backward()
    assert seen == [[True, True, True]]
    seen.clear()
    monkeypatch.setattr(GaussianAttention, "fused", False)
    attention.forward_packed(x, packing).sum().backward()
    assert seen and not all(seen[0])


def bucket_packing(lengths: list[int], length: int) -> Packing:
    mask = torch.arange(length)[None] < torch.tensor(lengths)[:, None]
    return Packing.from_mask(mask, len(lengths), length, "cpu")


def test_length_buckets_partition_the_tokens_by_video_length():
    """gmm.length_buckets: equal video counts by increasing length, each bucket padded to its longest video
    rounded up to LENGTH_STEP (at most the batch's length); every packed token in exactly one bucket, at its
    video's row in the bucket and its own position (a hand loop over the packing); None where nothing is
    padded, where the work would not fall enough, or for a mask that is not each video's first positions."""
    lengths = [5, 40, 17, 64, 3, 33, 9, 50]
    packing = bucket_packing(lengths, 64)
    buckets = gmm.length_buckets(packing, 4)
    starts = [sum(lengths[:b]) for b in range(len(lengths))]
    seen = []
    for bucket in buckets:
        videos = bucket.videos.tolist()
        assert len(videos) == 2 and videos == sorted(videos)
        longest = max(lengths[v] for v in videos)
        assert bucket.length == min(64, -(-longest // gmm.LENGTH_STEP) * gmm.LENGTH_STEP)
        assert bucket.packing.window_span == 64 and bucket.packing.batch == 2
        want_tokens, want_rows, want_positions = [], [], []
        for row, v in enumerate(videos):
            for t in range(lengths[v]):
                want_tokens.append(starts[v] + t), want_rows.append(row), want_positions.append(t)
        assert bucket.tokens.tolist() == want_tokens and bucket.rows.tolist() == want_rows
        assert bucket.positions.tolist() == want_positions
        seen += want_tokens
    assert sorted(seen) == list(range(sum(lengths)))
    assert [sorted(lengths[v] for v in b.videos.tolist()) for b in buckets] == [[3, 5], [9, 17], [33, 40], [50, 64]]
    assert gmm.length_buckets(bucket_packing([64] * 8, 64), 4) is None  # nothing padded
    assert gmm.length_buckets(bucket_packing([60, 64, 58, 63], 64), 4) is None  # every bucket 64 long: no gain
    assert gmm.length_buckets(packing, 1) is None
    gaps = torch.tensor([[True, False, True, True], [True, True, False, False]])  # not each row's first positions
    built = Packing(2, 4, gaps.sum(1), torch.tensor([0, 2, 3, 0, 1]), gaps.reshape(-1).nonzero().squeeze(1), gaps)
    assert gmm.length_buckets(built, 2) is None


@pytest.mark.parametrize("window", ["official", "official_raw", "centred"])
def test_a_buckets_windows_are_the_top_left_block_of_the_batchs(window):
    """A bucket attends with the first L_b positions of the batch's windows (span = the batch's length), the
    same values as the (L, L) windows cut to (L_b, L_b), for the padded span and per-video real lengths."""
    sigmas = (0.05, 0.3, 1.0, 5.0)
    full = gmm._cached_stack(96, 96, sigmas, window, 1.0, torch.float32, torch.device("cpu"))
    part = gmm._cached_stack(48, 96, sigmas, window, 1.0, torch.float32, torch.device("cpu"))
    assert torch.equal(part, full[..., :48, :48])
    lengths = torch.tensor([48, 40, 7, 1])
    assert torch.equal(gmm.batched_windows(lengths, 48, sigmas, window), gmm.batched_windows(lengths, 96, sigmas, window)[..., :48, :48])


@pytest.mark.parametrize("window", ["official", "centred"])
@pytest.mark.parametrize("window_length", ["padded", "real", 80])
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16-autocast"])
def test_attention_over_length_buckets_equals_attention_over_the_batch(window, window_length, amp, monkeypatch):
    """GaussianAttention's fast CPU path over length buckets gives the unbucketed output and gradients (input
    and Q/K/V weights): float32 to 1e-5 of scale, bf16 autocast to BF16_TOL; with attention dropout in
    training it does not bucket (the batch's draw) and gives the same values."""
    torch.manual_seed(0)
    lengths = torch.randint(3, 65, (24,))
    lengths[0], lengths[1], lengths[2] = 64, 0, 0  # two videos without a frame
    packing = bucket_packing(lengths.tolist(), 64)
    assert gmm.length_buckets(packing, 4) is not None
    for dropout in (0.0, 0.2):
        attention = GaussianAttention(hidden_size=32, num_heads=2, sigmas=(0.3, 1.0, float("inf")), window=window,
                                      window_length=window_length, dropout=dropout).train()
        x = torch.randn(packing.num_tokens, 32)
        weights = torch.linspace(-1, 1, 3 * packing.num_tokens * 32).view(3, -1, 32)
        runs, calls = [], []
        monkeypatch.setattr(gmm, "_BucketMerge", type("Spy", (), {"apply": staticmethod(
            lambda *a, _f=gmm._BucketMerge.apply: calls.append(1) or _f(*a))}))
        for count in (1, 4):
            monkeypatch.setattr(GaussianAttention, "max_buckets", count)
            torch.manual_seed(5)
            leaf = x.clone().requires_grad_()
            attention.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                y = attention.forward_packed(leaf, packing)
            (y.float() * weights).sum().backward()
            runs.append((y.detach().float(), leaf.grad, attention.qkv.weight.grad.clone()))
        assert bool(calls) == (dropout == 0.0)  # bucketed only without attention dropout
        for got, want in zip(runs[1], runs[0]):
            assert_close_scaled(got, want, BF16_TOL if amp else FP32_TOL, f"buckets {window_length}")


def test_length_buckets_leave_empty_batches_hand_built_layouts_and_short_spans_to_the_batchs_path(monkeypatch):
    """No bucketing (the batch's own path) for a batch without a real token, for tokens out of row order,
    and for an int window span shorter than the batch (which that path refuses); a packing's own window_span
    carries over to its buckets."""
    assert gmm.length_buckets(bucket_packing([0, 0, 0, 0], 16), 4) is None
    attention = GaussianAttention(hidden_size=16, num_heads=2, sigmas=(0.3, 1.0))
    assert attention.forward_packed(torch.zeros(0, 16), bucket_packing([0, 0], 16)).shape == (2, 0, 16)
    mask = torch.tensor([[True, True, False, False], [True, True, False, False]])
    shuffled = Packing(2, 4, torch.tensor([2, 2]), torch.tensor([0, 1, 0, 1]), torch.tensor([0, 5, 4, 1]), mask)
    assert gmm.length_buckets(shuffled, 2) is None
    packing = bucket_packing([5, 40, 17, 64, 3, 33, 9, 50], 64)
    spanned = dataclasses.replace(packing, window_span=128)
    assert {b.packing.window_span for b in gmm.length_buckets(spanned, 4)} == {128}
    short = GaussianAttention(hidden_size=16, num_heads=2, sigmas=(0.3, 1.0), window_length=48)
    with pytest.raises(ValueError, match="window_length=48"):
        short.forward_packed(torch.randn(int(sum([5, 40, 17, 30, 3, 33, 9, 20])), 16), bucket_packing([5, 40, 17, 30, 3, 33, 9, 20], 64))


@pytest.mark.skipif(not blocks._fused_linear(torch.bfloat16), reason="no oneDNN fused bf16 linear in this torch or on this CPU")
def test_input_projection_trains_its_linear_through_project_with_the_modules_values(monkeypatch):
    """InputProjection under bf16 autocast with autograd: its linear runs as blocks.project's one fused call
    (_BiasLinear: the bias inside the GEMM, weight_grad's product for the weight gradient); the outputs equal
    the module call's bit for bit and every gradient (the linear's, the LayerNorm's affine) is the module
    path's to the bf16 tolerance, with the same dropout mask."""
    torch.manual_seed(0)
    proj = blocks.InputProjection(in_dim=96, out_dim=48, dropout=0.25).train()
    with torch.no_grad():
        proj.linear.bias.normal_(0.0, 2.0)
        proj.norm.weight.normal_(1.0, 0.3)
        proj.norm.bias.normal_(0.0, 0.3)
    x = torch.randn(3, 41, 96)
    probe = torch.randn(3, 41, 48)
    fused = []
    real_apply = blocks._BiasLinear.apply
    monkeypatch.setattr(blocks._BiasLinear, "apply", lambda *a: fused.append(a[0].shape) or real_apply(*a))

    def run():
        proj.zero_grad(set_to_none=True)
        torch.manual_seed(7)  # the dropout's draw
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = proj(x)
        (y.float() * probe).sum().backward()
        return y.detach(), {n: p.grad.clone() for n, p in proj.named_parameters()}

    fast, fast_grads = run()
    assert fused == [(3 * 41, 96)]
    monkeypatch.setattr(blocks, "project", lambda layer, h, parts=1: layer(h))  # the module call
    plain, plain_grads = run()
    assert len(fused) == 1 and fast.dtype == torch.bfloat16
    assert torch.equal(fast, plain)
    assert (plain == 0).float().mean() > 0.3  # the ReLU cut some outputs (the comparison covers its backward)
    assert fast_grads.keys() == plain_grads.keys() == {"norm.weight", "norm.bias", "linear.weight", "linear.bias"}
    for name in plain_grads:
        assert_close_scaled(fast_grads[name], plain_grads[name], BF16_TOL, f"grad of {name}")


@pytest.mark.skipif(not blocks._fused_linear(torch.bfloat16), reason="no oneDNN fused bf16 linear in this torch or on this CPU")
def test_flop_counts_see_the_fused_linear_and_empty_inputs_project_to_empty_outputs():
    """FlopCounterMode has no formula of its own for oneDNN's fused linear: blocks registers one, so a bf16
    input projection counts the FLOPs the float32 one does (forward and backward, 2 x rows x in x out
    each), and blocks.project maps an input without rows to an output without rows, as the module does."""
    from torch.utils.flop_counter import FlopCounterMode

    proj = blocks.InputProjection(in_dim=64, out_dim=32, dropout=0.1).train()
    counts = {}
    for amp in (False, True):
        counter = FlopCounterMode(display=False)
        with counter, torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            proj(torch.randn(10, 64)).sum().backward()
        counts[amp] = counter.get_total_flops()
    assert counts[True] == counts[False] == 3 * 2 * 10 * 64 * 32  # forward, input gradient, weight gradient
    layer = torch.nn.Linear(96, 48)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for shape in ((0, 96), (2, 0, 96)):
            x = torch.randn(*shape, requires_grad=True)
            assert blocks.project(layer, x).shape == layer(x).shape == (*shape[:-1], 48)
