"""ral_da and ral_pm against hand-written loops."""

from __future__ import annotations

import math

import pytest
import torch

from prvrlab.losses.ral_da import RALDistributionAlignmentLoss
from prvrlab.losses.ral_pm import RALProxyMatchingLoss
from prvrlab.models.base import ModelOutput, QueryEmbedding, VideoEmbedding
from device_under_test import DEVICE


def output(**aux) -> ModelOutput:
    return ModelOutput(scores={}, query=QueryEmbedding(), video=VideoEmbedding(), aux={f"ral.{k}": v for k, v in aux.items()})


def kl_loop(mu_a, lv_a, mu_b, lv_b):
    total = 0.0
    for d in range(len(mu_a)):
        va, vb = math.exp(lv_a[d]), math.exp(lv_b[d])
        total += 0.5 * (math.log(vb / va) + (va + (mu_a[d] - mu_b[d]) ** 2) / vb - 1)
    return total


def test_ral_da_matches_a_loop():
    g = torch.Generator(DEVICE).manual_seed(0)
    t_mu, t_lv = torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g)
    v_mu, v_lv = torch.randn(3, 3, generator=g), torch.randn(3, 3, generator=g)
    text_video = torch.tensor([0, 0, 1, 2])
    out = output(text_mu=t_mu, text_logvar=t_lv, video_mu=v_mu, video_logvar=v_lv, text_video=text_video)
    zeros = [0.0] * 3
    cross = sum(kl_loop(t_mu[t].tolist(), t_lv[t].tolist(), v_mu[text_video[t]].tolist(), v_lv[text_video[t]].tolist()) for t in range(4)) / 4
    prior_t = sum(kl_loop(t_mu[t].tolist(), t_lv[t].tolist(), zeros, zeros) for t in range(4)) / 4
    prior_v = sum(kl_loop(v_mu[v].tolist(), v_lv[v].tolist(), zeros, zeros) for v in range(3)) / 3
    paper = RALDistributionAlignmentLoss(formulation="paper")
    assert paper(out, None, epoch=0).item() == pytest.approx(cross + prior_t + prior_v, rel=1e-5)
    half = RALDistributionAlignmentLoss(formulation="paper", prior_weight=0.5)(out, None, epoch=0).item()
    assert half == pytest.approx(cross + 0.5 * (prior_t + prior_v), rel=1e-5)


def test_ral_da_is_zero_for_identical_standard_gaussians():
    z = torch.zeros(2, 4)
    out = output(
        text_mu=z, text_logvar=z, video_mu=z, video_logvar=z, text_sample_mean=z, video_sample_mean=z,
        text_video=torch.tensor([0, 1]),
    )
    for formulation in ("paper", "official"):  # log sigma = 0 is also log-variance 0
        loss = RALDistributionAlignmentLoss(formulation=formulation)(out, None, epoch=0).item()
        assert loss == pytest.approx(0.0, abs=1e-7)


@pytest.mark.parity
def test_ral_da_official_matches_a_loop():
    """Official KLdivergence: sample means, log sigma = lv / 2 passed as a log-variance in the prior terms."""
    g = torch.Generator(DEVICE).manual_seed(2)
    t_mean, t_lv = torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g)
    v_mean, v_lv = torch.randn(3, 3, generator=g), torch.randn(3, 3, generator=g)
    text_video = [0, 0, 1, 2]
    out = output(
        text_mu=torch.full((4, 3), 9.0), text_logvar=t_lv, video_mu=torch.full((3, 3), 9.0), video_logvar=v_lv,
        text_sample_mean=t_mean, video_sample_mean=v_mean, text_video=torch.tensor(text_video),
    )  # mu is not read

    def prior(m, lv):
        return sum(-0.5 * (1 + lv[d] / 2 - m[d] ** 2 - math.exp(lv[d] / 2)) for d in range(3))

    def cross(mt, lvt, mv, lvv):
        total = 0.0
        for d in range(3):
            st, sv = math.exp(lvt[d] / 2), math.exp(lvv[d] / 2)  # official "var" = exp(log sigma) = sigma
            total += math.log(sv) - math.log(st) + (st**2 + (mt[d] - mv[d]) ** 2) / (2 * sv**2) - 0.5
        return total

    tm, tl, vm, vl = t_mean.tolist(), t_lv.tolist(), v_mean.tolist(), v_lv.tolist()
    c = sum(cross(tm[t], tl[t], vm[text_video[t]], vl[text_video[t]]) for t in range(4)) / 4
    p = sum(prior(tm[t], tl[t]) for t in range(4)) / 4 + sum(prior(vm[v], vl[v]) for v in range(3)) / 3
    loss = RALDistributionAlignmentLoss()(out, None, epoch=0).item()  # official is the default
    assert loss == pytest.approx(c + p, rel=1e-5)
    half = RALDistributionAlignmentLoss(formulation="official", prior_weight=0.5)(out, None, epoch=0).item()
    assert half == pytest.approx(c + 0.5 * p, rel=1e-5)
    # the two formulations differ on the same Gaussians
    same = output(
        text_mu=t_mean, text_logvar=t_lv, video_mu=v_mean, video_logvar=v_lv,
        text_sample_mean=t_mean, video_sample_mean=v_mean, text_video=torch.tensor(text_video),
    )
    paper = RALDistributionAlignmentLoss(formulation="paper")(same, None, epoch=0).item()
    assert paper != pytest.approx(RALDistributionAlignmentLoss()(same, None, epoch=0).item(), rel=1e-3)


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
    g = torch.Generator(DEVICE).manual_seed(1)
    tv = torch.tensor(text_video)
    text, video = torch.randn(len(text_video), 3, 5, generator=g), torch.randn(3, 3, 5, generator=g)
    out = output(text_proxies=text, video_proxies=video, text_video=tv)
    loss = RALProxyMatchingLoss(formulation="paper", tau=0.5, bidirectional=bidirectional)
    assert loss(out, None, epoch=0).item() == pytest.approx(pm_loop(text, video, tv, 0.5, bidirectional), rel=1e-5)


def pm_official_loop(text, video, text_video):
    """MILNCELoss_BoF both ways: raw dots, -mean over positives of log softmax, directions averaged."""
    t, p, _ = text.shape
    b, pv, _ = video.shape
    rows = [(i, text[i, k]) for i in range(t) for k in range(p)]
    cols = [(v, video[v, k]) for v in range(b) for k in range(pv)]
    s = [[float(x @ y) for _, y in cols] for _, x in rows]

    def direction(lines, is_pos):
        total, n = 0.0, 0
        for a, line in enumerate(lines):
            logz = math.log(sum(math.exp(x) for x in line))
            pos = [line[c] - logz for c in range(len(line)) if is_pos(a, c)]
            if pos:
                total -= sum(pos) / len(pos)
                n += 1
        return total / n

    t2v = direction(s, lambda r, c: cols[c][0] == int(text_video[rows[r][0]]))
    columns = [[s[r][c] for r in range(len(rows))] for c in range(len(cols))]
    v2t = direction(columns, lambda c, r: cols[c][0] == int(text_video[rows[r][0]]))
    return (t2v + v2t) / 2


@pytest.mark.parity
@pytest.mark.parametrize("text_video", [[0, 1, 2], [0, 0, 2, 2]])
def test_ral_pm_official_matches_a_loop(text_video):
    g = torch.Generator(DEVICE).manual_seed(3)
    tv = torch.tensor(text_video)
    text, video = torch.randn(len(text_video), 3, 5, generator=g), torch.randn(3, 3, 5, generator=g)
    out = output(text_proxies=text, video_proxies=video, text_video=tv)
    got = RALProxyMatchingLoss()(out, None, epoch=0).item()  # official is the default; tau is not used
    assert got == pytest.approx(pm_official_loop(text, video, tv), rel=1e-5)
    assert RALProxyMatchingLoss(tau=0.01)(out, None, epoch=0).item() == pytest.approx(got, rel=1e-6)


@pytest.mark.parity
def test_ral_pm_official_by_hand():
    """One proxy per unit, D = 1: s = [[1, 1], [2, 2]] (text x video); text t matches video t."""
    out = output(
        text_proxies=torch.tensor([[[1.0]], [[2.0]]]),
        video_proxies=torch.tensor([[[1.0]], [[1.0]]]),
        text_video=torch.tensor([0, 1]),
    )
    # rows: -log softmax([a, a]) = log 2 each; columns [1, 2]: -log softmax at row 0 (1) and at row 1 (2)
    t2v = math.log(2)
    v2t = ((math.log(math.e + math.e**2) - 1) + (math.log(math.e + math.e**2) - 2)) / 2
    assert RALProxyMatchingLoss()(out, None, epoch=0).item() == pytest.approx((t2v + v2t) / 2, rel=1e-6)


def test_ral_pm_one_video_is_zero_and_finite():
    out = output(text_proxies=torch.randn(1, 7, 4), video_proxies=torch.randn(1, 7, 4), text_video=torch.tensor([0]))
    assert RALProxyMatchingLoss(formulation="paper")(out, None, epoch=0).item() == pytest.approx(0.0, abs=1e-6)
    official = RALProxyMatchingLoss()(out, None, epoch=0)  # -mean log softmax over all-positive rows: >= 0
    assert torch.isfinite(official) and official.item() >= 0


@pytest.mark.parametrize("cls", [RALDistributionAlignmentLoss, RALProxyMatchingLoss])
def test_clear_error_when_the_plugin_is_off(cls):
    with pytest.raises(ValueError, match="plugins.ral"):
        cls()(output(), None, epoch=0)


def test_parameter_validation():
    with pytest.raises(ValueError, match="tau"):
        RALProxyMatchingLoss(tau=0.0)
    with pytest.raises(ValueError, match="prior_weight"):
        RALDistributionAlignmentLoss(prior_weight=-1.0)
    for cls in (RALDistributionAlignmentLoss, RALProxyMatchingLoss):
        with pytest.raises(ValueError, match="formulation"):
            cls(formulation="eq10")
