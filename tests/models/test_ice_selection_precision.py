"""ICE's mining and IRM's key moment select on fp32 cosines under bf16 autocast (as without it): bf16
products round cosines near 1 to steps of 2^-8, which ties close moments and hands them to the lower index."""

from __future__ import annotations

import torch

from prvrlab.models.base import QueryEmbedding, VideoEmbedding
from prvrlab.models.plugins.ice import ICE, cosine_matrix

from device_under_test import DEVICE


def _close_moments() -> tuple[torch.Tensor, torch.Tensor]:
    """One query and two moments of its video with cosines 0.9990 and 0.9996 to it: one bf16 step apart
    at most, so bf16 rounding can tie them, while fp32 tells them apart (the second is closer)."""
    q = torch.zeros(1, 8)
    q[0, 0] = 1.0
    angles = torch.tensor([0.9990, 0.9996]).acos()
    moments = torch.zeros(1, 2, 8)  # (Nv, M, D)
    moments[0, :, 0] = angles.cos()
    moments[0, :, 1] = angles.sin()
    return q, moments


def test_cosine_matrix_is_fp32_and_unchanged_under_autocast():
    torch.manual_seed(0)
    a, b = torch.randn(6, 16), torch.randn(5, 16)
    plain = cosine_matrix(a, b)
    with torch.autocast(device_type=DEVICE.type, dtype=torch.bfloat16):
        mixed = cosine_matrix(a, b)
    assert mixed.dtype == torch.float32 and torch.equal(mixed, plain)


def test_irm_key_moment_is_the_fp32_argmax_under_autocast():
    q, moments = _close_moments()
    cos = cosine_matrix(moments[0], q)[:, 0]  # (M,)
    assert int(cos.argmax()) == 1  # fp32: the second moment is the key
    with torch.autocast(device_type=DEVICE.type, dtype=torch.bfloat16):
        rounded = (moments[0] @ q[0])  # what a bf16 product gives
    assert rounded[0] == rounded[1]  # the tie the plug-in must not see
    plugin = ICE(hidden_size=8, ice=False, tcp=False)
    video = VideoEmbedding(frame=torch.zeros(1, 8), extra={"moment_tokens": moments, "moment_mask": torch.ones(1, 2, dtype=torch.bool)})
    query = QueryEmbedding(vectors={plugin.moment_branch: q, plugin.video_branch: q})
    with torch.autocast(device_type=DEVICE.type, dtype=torch.bfloat16):
        aux = plugin._irm(query, video, torch.tensor([0]))
    assert torch.equal(aux["key_moment"][0], moments[0, 1])


def test_ice_mining_picks_the_fp32_best_moment_under_autocast():
    q, moments = _close_moments()
    other = torch.zeros(1, 1, 8)
    other[0, 0, 2] = 1.0  # the query's own video: one orthogonal moment
    plugin = ICE(hidden_size=8, irm=False, tcp=False, threshold=0.5)
    video = VideoEmbedding(extra={"moment_tokens": torch.cat([other.expand(1, 2, 8), moments]), "moment_mask": torch.ones(2, 2, dtype=torch.bool)})
    query = QueryEmbedding(vectors={plugin.moment_branch: q})
    with torch.autocast(device_type=DEVICE.type, dtype=torch.bfloat16):
        aux = plugin._ice(query, video, torch.tensor([0]))
    assert aux["pair_video"].tolist() == [1] and torch.equal(aux["pair_moment"][0], moments[0, 1])
