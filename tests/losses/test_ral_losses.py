"""ral_da and ral_pm against hand-written loops."""

from __future__ import annotations

import math

import pytest
import torch

from prvrlab.losses.ral_da import RALDistributionAlignmentLoss
from prvrlab.losses.ral_pm import RALProxyMatchingLoss
from prvrlab.models.base import ModelOutput, QueryEmbedding, VideoEmbedding


def output(**aux) -> ModelOutput:
    return ModelOutput(scores={}, query=QueryEmbedding(), video=VideoEmbedding(), aux={f"ral.{k}": v for k, v in aux.items()})


def kl_loop(mu_a, lv_a, mu_b, lv_b):
    total = 0.0
    for d in range(len(mu_a)):
        va, vb = math.exp(lv_a[d]), math.exp(lv_b[d])
        total += 0.5 * (math.log(vb / va) + (va + (mu_a[d] - mu_b[d]) ** 2) / vb - 1)
    return total


def test_ral_da_matches_a_loop():
    g = torch.Generator().manual_seed(0)
    t_mu, t_lv = torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g)
    v_mu, v_lv = torch.randn(3, 3, generator=g), torch.randn(3, 3, generator=g)
    text_video = torch.tensor([0, 0, 1, 2])
    out = output(text_mu=t_mu, text_logvar=t_lv, video_mu=v_mu, video_logvar=v_lv, text_video=text_video)
    zeros = [0.0] * 3
    cross = sum(kl_loop(t_mu[t].tolist(), t_lv[t].tolist(), v_mu[text_video[t]].tolist(), v_lv[text_video[t]].tolist()) for t in range(4)) / 4
    prior_t = sum(kl_loop(t_mu[t].tolist(), t_lv[t].tolist(), zeros, zeros) for t in range(4)) / 4
    prior_v = sum(kl_loop(v_mu[v].tolist(), v_lv[v].tolist(), zeros, zeros) for v in range(3)) / 3
    assert RALDistributionAlignmentLoss()(out, None, epoch=0).item() == pytest.approx(cross + prior_t + prior_v, rel=1e-5)
    half = RALDistributionAlignmentLoss(prior_weight=0.5)(out, None, epoch=0).item()
    assert half == pytest.approx(cross + 0.5 * (prior_t + prior_v), rel=1e-5)


def test_ral_da_is_zero_for_identical_standard_gaussians():
    z = torch.zeros(2, 4)
    out = output(text_mu=z, text_logvar=z, video_mu=z, video_logvar=z, text_video=torch.tensor([0, 1]))
    assert RALDistributionAlignmentLoss()(out, None, epoch=0).item() == pytest.approx(0.0, abs=1e-7)


def pm_loop(text, video, text_video, tau, bidirectional):
    t, p, _ = text.shape
    b, pv, _ = video.shape
    rows = [(i, text[i, k]) for i in range(t) for k in range(p)]
    cols = [(v, video[v, k]) for v in range(b) for k in range(pv)]
    s = [[float(torch.cosine_similarity(x, y, dim=0)) / tau for _, y in cols] for _, x in rows]
    loss = 0.0
    for r, (i, _) in enumerate(rows):
        num = sum(math.exp(s[r][c]) for c, (v, _) in enumerate(cols) if v == int(text_video[i]))
        den = sum(math.exp(x) for x in s[r])
        loss -= math.log(num / den)
    loss /= len(rows)
    if bidirectional:
        v2t, n = 0.0, 0
        for c, (v, _) in enumerate(cols):
            pos = [s[r][c] for r, (i, _) in enumerate(rows) if int(text_video[i]) == v]
            if not pos:
                continue
            v2t -= math.log(sum(math.exp(x) for x in pos) / sum(math.exp(s[r][c]) for r in range(len(rows))))
            n += 1
        loss += v2t / n
    return loss


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("text_video", [[0, 1, 2], [0, 0, 2, 2]])
def test_ral_pm_matches_a_loop(bidirectional, text_video):
    g = torch.Generator().manual_seed(1)
    tv = torch.tensor(text_video)
    text, video = torch.randn(len(text_video), 3, 5, generator=g), torch.randn(3, 3, 5, generator=g)
    out = output(text_proxies=text, video_proxies=video, text_video=tv)
    got = RALProxyMatchingLoss(tau=0.5, bidirectional=bidirectional)(out, None, epoch=0).item()
    assert got == pytest.approx(pm_loop(text, video, tv, 0.5, bidirectional), rel=1e-5)


def test_ral_pm_one_video_is_zero_and_finite():
    out = output(text_proxies=torch.randn(1, 7, 4), video_proxies=torch.randn(1, 7, 4), text_video=torch.tensor([0]))
    assert RALProxyMatchingLoss()(out, None, epoch=0).item() == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("cls", [RALDistributionAlignmentLoss, RALProxyMatchingLoss])
def test_clear_error_when_the_plugin_is_off(cls):
    with pytest.raises(ValueError, match="plugins.ral"):
        cls()(output(), None, epoch=0)


def test_parameter_validation():
    with pytest.raises(ValueError, match="tau"):
        RALProxyMatchingLoss(tau=0.0)
    with pytest.raises(ValueError, match="prior_weight"):
        RALDistributionAlignmentLoss(prior_weight=-1.0)
