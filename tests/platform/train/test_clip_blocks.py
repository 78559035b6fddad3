"""Per-tensor clipping (``train.clip_grad: per_tensor``) acts on the reference's tensors, not prvrlab's merged ones.

The reference's BertAdam clips each parameter tensor to norm 1 on its own.  prvrlab holds several of the
reference's tensors in one (every branch's Q/K/V in one projection, K branches' output maps or LayerNorm
affines in one (K, ...) tensor, MS-SL's frame key and value maps), so each module names those as equal
blocks (``clip_parts``) and :class:`BertAdam` clips each block as the reference clips that tensor.
"""

from __future__ import annotations

import pytest
import torch

from prvrlab.models.factory import build_model
from prvrlab.platform.config import load_config
from prvrlab.platform.train.optim import BertAdam, build_optimizer, clip_blocks, clip_joint


@pytest.mark.parametrize("fused", [True, False])
def test_a_merged_tensor_clipped_in_blocks_steps_as_its_separate_tensors(fused):
    torch.manual_seed(0)
    weight = torch.randn(12, 4)
    bias = torch.randn(12)
    # block norms far above, just above and below the limit: each block scaled on its own (or not at all)
    grad_w = torch.randn(12, 4) * torch.tensor([5.0, 0.3, 0.05]).repeat_interleave(4)[:, None]
    grad_b = torch.randn(12) * torch.tensor([0.01, 3.0, 0.6]).repeat_interleave(4)
    merged = [torch.nn.Parameter(weight.clone()), torch.nn.Parameter(bias.clone())]
    merged[0].grad, merged[1].grad = grad_w.clone(), grad_b.clone()
    parts = [torch.nn.Parameter(t.clone()) for t in (*weight.chunk(3), *bias.chunk(3))]
    for p, g in zip(parts, (*grad_w.chunk(3), *grad_b.chunk(3))):
        p.grad = g.clone()
    block_norms = [float(g.norm()) for g in (*grad_w.chunk(3), *grad_b.chunk(3))]
    assert min(block_norms) < 1.0 < max(block_norms)  # the worked example clips some blocks, not all
    assert float(grad_w.norm()) > 1.0 and float(grad_b.norm()) > 1.0  # whole-tensor clipping would scale every block

    BertAdam(merged, lr=0.1, weight_decay=0.01, max_grad_norm=1.0, fused=fused,
             clip_blocks={merged[0]: 3, merged[1]: 3}).step()
    BertAdam(parts, lr=0.1, weight_decay=0.01, max_grad_norm=1.0, fused=fused).step()
    torch.testing.assert_close(merged[0].detach(), torch.cat([p.detach() for p in parts[:3]]))
    torch.testing.assert_close(merged[1].detach(), torch.cat([p.detach() for p in parts[3:]]))
    for g, norm in zip((*merged[0].grad.chunk(3), *merged[1].grad.chunk(3)), block_norms):
        assert float(g.norm()) == pytest.approx(min(norm, 1.0 / (1 + 1e-6 / norm)), rel=1e-5)


def test_blocks_that_do_not_divide_the_tensor_are_refused():
    p = torch.nn.Parameter(torch.zeros(10, 2))
    with pytest.raises(ValueError, match="3 blocks"):
        BertAdam([p], lr=0.1, clip_blocks={p: 3})


@pytest.mark.parametrize("config, reference_tensors", [("mssl_tvr", 54), ("gmmformer_tvr", 193), ("gmmformer_v2_tvr", 297 - 2)])
def test_the_clipped_units_are_the_reference_models_tensors(config, reference_tensors):
    """The official models' parameter tensors (ms-sl @ e014c31 ``method/model.py``: separate Q, K, V per
    attention and two ``mapping_linear`` layers; GMMFormer @ c38df37: one ``BertAttention`` per Gaussian
    branch, each with its own Q, K, V, output dense and LayerNorm): 54 and 193.  GMMFormer_v2 @ 5bacac9
    (``GMMFormerV2_Net`` on the TVR config): 297, of which prvrlab lacks the two cross-attentions' key
    biases (a key bias cancels in the softmax: its gradient is 0, so clipping it changes nothing)."""
    model = build_model(load_config(f"configs/{config}.yaml").model, video_dim=1024, query_dim=768)
    params = [p for p in model.parameters() if p.requires_grad]
    blocks = clip_blocks(model)
    assert len(params) < reference_tensors  # merged tensors hold several of the reference's
    assert sum(blocks.get(p, 1) for p in params) == reference_tensors
    optimizer, _ = build_optimizer(model, lr=1e-4, weight_decay=0.01, total_steps=10, warmup_proportion=0.1, max_grad_norm=1.0)
    assert optimizer.clip_blocks == blocks


def test_each_gaussian_branch_is_clipped_alone():
    """A GMMFormer block whose first branch has a huge gradient: only that branch's Q/K/V rows are scaled."""
    model = build_model(load_config("configs/gmmformer_tvr.yaml").model, video_dim=1024, query_dim=768)
    attention = next(m for m in model.modules() if hasattr(m, "qkv"))
    qkv = attention.qkv.weight
    K, D = attention.num_branches, attention.hidden_size
    assert clip_blocks(model)[qkv] == 3 * K
    grad = torch.full_like(qkv, 1e-4)
    grad[:D] = 10.0  # branch 0's Q rows
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    qkv.grad = grad.clone()
    optimizer, _ = build_optimizer(model, lr=1e-4, weight_decay=0.0, total_steps=10, warmup_proportion=0.0, max_grad_norm=1.0)
    optimizer.step()
    assert float(qkv.grad[:D].norm()) == pytest.approx(1.0, rel=1e-3)  # from 10 x D; fp32 norms of 147k equal terms
    torch.testing.assert_close(qkv.grad[D:], grad[D:])  # every other block untouched, as the reference's tensors


@pytest.mark.parametrize("fused", [True, False])
def test_tensors_clipped_together_step_as_the_one_tensor_they_split(fused):
    """MamFusion's fusion holds Q and K|V apart where the reference's nn.MultiheadAttention packs them in one
    (3D, D) in-projection: clipped by their joint norm they step as that one tensor."""
    torch.manual_seed(1)
    packed = torch.randn(12, 4)
    grad = torch.randn(12, 4) * torch.tensor([2.0, 0.1, 0.1]).repeat_interleave(4)[:, None]
    assert float(grad[:4].norm()) > 1.0 > float(grad[4:].norm())  # apart, only Q would be scaled
    query, key_value = torch.nn.Parameter(packed[:4].clone()), torch.nn.Parameter(packed[4:].clone())
    query.grad, key_value.grad = grad[:4].clone(), grad[4:].clone()
    whole = torch.nn.Parameter(packed.clone())
    whole.grad = grad.clone()
    BertAdam([query, key_value], lr=0.1, max_grad_norm=1.0, fused=fused, clip_joint=[(query, key_value)]).step()
    BertAdam([whole], lr=0.1, max_grad_norm=1.0, fused=fused).step()
    torch.testing.assert_close(torch.cat([query.detach(), key_value.detach()]), whole.detach())
    assert float(torch.cat([query.grad, key_value.grad]).norm()) == pytest.approx(1.0, rel=1e-5)


def test_a_parameter_in_two_units_is_refused():
    a, b = torch.nn.Parameter(torch.zeros(4, 2)), torch.nn.Parameter(torch.zeros(4, 2))
    with pytest.raises(ValueError, match="two clipping units"):
        BertAdam([a, b], lr=0.1, clip_joint=[(a, b), (b,)])
    with pytest.raises(ValueError, match="two clipping units"):
        BertAdam([a, b], lr=0.1, clip_blocks={a: 2}, clip_joint=[(a, b)])


def test_mamfusions_fusions_clip_their_projections_as_one_in_projection():
    model = build_model(load_config("configs/mamfusion_tvr.yaml").model, video_dim=1024, query_dim=768)
    fusions = [m for m in model.modules() if hasattr(m, "key_value")]
    assert len(fusions) == 2  # text-to-video and video-to-text
    joint = {tuple(id(p) for p in members) for members in clip_joint(model)}
    for fusion in fusions:
        assert (id(fusion.query.weight), id(fusion.key_value.weight)) in joint
        assert (id(fusion.query.bias), id(fusion.key_value.bias)) in joint
    optimizer, _ = build_optimizer(model, lr=1e-4, weight_decay=0.01, total_steps=10, warmup_proportion=0.1, max_grad_norm=1.0)
    assert len(optimizer.clip_joint) == 4


def test_ral_on_gmmformer_v2_clips_the_reference_models_tensors():
    """RAL-PRVR @ befbf22 (``RAL4GMMV2_Net`` on its TVR config): 343 tensors, of which prvrlab again lacks the
    two cross-attention key biases; the plug-in's second text encoder's Q/K/V are clipped as three."""
    from prvrlab.models.factory import build_system

    raw = load_config("configs/gmmformer_v2_ral_tvr.yaml").to_dict()
    system = build_system(raw["model"], raw.get("plugins"), raw["losses"], video_dim=1024, query_dim=768)
    params = [p for p in system.parameters() if p.requires_grad]
    blocks, joint = clip_blocks(system), clip_joint(system)
    assert sum(blocks.get(p, 1) for p in params) - sum(len(m) - 1 for m in joint) == 343 - 2
