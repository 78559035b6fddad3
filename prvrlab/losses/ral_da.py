"""RAL distribution-alignment loss L_DA.

Reads the ``ral`` plug-in's MSRA outputs: text Gaussians N(mu_t, diag exp(lv_t))
(T units: videos' query support sets, or single queries), their video index
``text_video`` (T,), and video Gaussians N(mu_v, diag exp(lv_v)) (B,).

``formulation="paper"`` (Eq. 8)::

    KL(t || v) = 1/2 sum_d [ lv_v - lv_t + (exp(lv_t) + (mu_t - mu_v)^2) / exp(lv_v) - 1 ]
    KL(m || N(0, I)) = 1/2 sum_d [ exp(lv_m) + mu_m^2 - 1 - lv_m ]

    loss = mean_t KL(t || video(t)) + prior_weight * (mean_t KL(t || N) + mean_v KL(v || N))

``formulation="official"`` (the official code's ``KLdivergence``): m = the
mean of the K sampled proxies in place of mu, ls = lv / 2 = log sigma (the
official heads predict log sigma), and the prior terms take ls where the
standard formula expects a log-variance::

    cross(t, v) = sum_d [ ls_v - ls_t + (exp(2 ls_t) + (m_t - m_v)^2) / (2 exp(2 ls_v)) - 1/2 ]
    prior(m)    = -1/2 sum_d [ 1 + ls_m - m_m^2 - exp(ls_m) ]

    loss = mean_t cross(t, video(t)) + prior_weight * (mean_t prior(t) + mean_v prior(v))

Sums over the D dimensions, means over units (so lambda_DA multiplies a
per-unit KL, as the paper's 1e-3 / 2.5e-4 scale suggests); ``prior_weight=1``
is Eq. 8 / the official sum.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from torch import Tensor

from prvrlab.data.batch import Batch
from prvrlab.checks import check_choice, check_number
from prvrlab.losses._common import plugin_aux
from prvrlab.losses.base import Loss
from prvrlab.models.base import ModelOutput
from prvrlab.registry import LOSSES

_KEYS = ("text_mu", "text_logvar", "video_mu", "video_logvar", "text_video")
_OFFICIAL_KEYS = ("text_sample_mean", "text_logvar", "video_sample_mean", "video_logvar", "text_video")


def kl_gaussians(mu_a: Tensor, lv_a: Tensor, mu_b: Tensor, lv_b: Tensor) -> Tensor:
    """KL(N(mu_a, e^lv_a) || N(mu_b, e^lv_b)) of diagonal Gaussians, summed over the last dim."""
    return 0.5 * (lv_b - lv_a + (lv_a.exp() + (mu_a - mu_b) ** 2) * (-lv_b).exp() - 1.0).sum(dim=-1)


def kl_standard(mu: Tensor, lv: Tensor) -> Tensor:
    """KL(N(mu, e^lv) || N(0, I)), summed over the last dim."""
    return 0.5 * (lv.exp() + mu**2 - 1.0 - lv).sum(dim=-1)


def official_cross(m_a: Tensor, ls_a: Tensor, m_b: Tensor, ls_b: Tensor) -> Tensor:
    """KL(N(m_a, e^{2 ls_a}) || N(m_b, e^{2 ls_b})) from log sigmas, summed over the last dim."""
    return (ls_b - ls_a + ((2 * ls_a).exp() + (m_a - m_b) ** 2) / (2 * (2 * ls_b).exp()) - 0.5).sum(dim=-1)


def official_prior(m: Tensor, ls: Tensor) -> Tensor:
    """The official prior term: the N(0, I) KL formula fed log sigma as if it were a log-variance."""
    return -0.5 * (1.0 + ls - m**2 - ls.exp()).sum(dim=-1)


@LOSSES.register("ral_da")
class RALDistributionAlignmentLoss(Loss):
    """KL(text || video) plus ``prior_weight`` x the prior terms; see the module docstring."""

    corrected: ClassVar[dict[str, Any]] = {"formulation": "paper"}  # the `corrected` preset (docs/parity.md)

    def __init__(
        self, *, formulation: Literal["paper", "official"] = "official", prior_weight: float = 1.0, plugin: str = "ral"
    ) -> None:
        super().__init__()
        self.formulation = check_choice(formulation, "formulation", ("paper", "official"))
        self.prior_weight = check_number(prior_weight, "prior_weight", minimum=0.0)
        if not isinstance(plugin, str) or not plugin:
            raise ValueError(f"plugin must be a plug-in name, got {plugin!r}")
        self.plugin = plugin

    def required_aux(self) -> tuple[str, ...]:
        return tuple(f"{self.plugin}.{k}" for k in (_OFFICIAL_KEYS if self.formulation == "official" else _KEYS))

    def forward(self, out: ModelOutput, batch: Batch, *, epoch: int) -> Tensor:
        t_mu, t_lv, v_mu, v_lv, text_video = plugin_aux(out, self.required_aux(), "ral_da")
        t_mu, t_lv, v_mu, v_lv = t_mu.float(), t_lv.float(), v_mu.float(), v_lv.float()  # (T, D), (B, D)
        if t_mu.shape[0] == 0:
            return t_mu.sum() * 0.0
        if self.formulation == "official":
            t_ls, v_ls = 0.5 * t_lv, 0.5 * v_lv  # log sigma
            cross = official_cross(t_mu, t_ls, v_mu[text_video], v_ls[text_video]).mean()
            prior = official_prior(t_mu, t_ls).mean() + official_prior(v_mu, v_ls).mean()
        else:
            cross = kl_gaussians(t_mu, t_lv, v_mu[text_video], v_lv[text_video]).mean()
            prior = kl_standard(t_mu, t_lv).mean() + kl_standard(v_mu, v_lv).mean()
        return cross + self.prior_weight * prior
