"""RAL distribution-alignment loss L_DA (paper 000, Eq. 8).

Reads the ``ral`` plug-in's MSRA outputs: text Gaussians N(mu_t, diag exp(lv_t))
(T units: videos' query support sets, or single queries), their video index
``text_video`` (T,), and video Gaussians N(mu_v, diag exp(lv_v)) (B,)::

    KL(t || v) = 1/2 sum_d [ lv_v - lv_t + (exp(lv_t) + (mu_t - mu_v)^2) / exp(lv_v) - 1 ]
    KL(m || N(0, I)) = 1/2 sum_d [ exp(lv_m) + mu_m^2 - 1 - lv_m ]

    loss = mean_t KL(t || video(t)) + prior_weight * (mean_t KL(t || N) + mean_v KL(v || N))

Sums over the D dimensions, means over units (so lambda_DA multiplies a
per-unit KL, as the paper's 1e-3 / 2.5e-4 scale suggests); ``prior_weight=1``
is Eq. 8.
"""

from __future__ import annotations

from torch import Tensor

from prvrlab.data.batch import Batch
from prvrlab.checks import check_number
from prvrlab.losses._common import plugin_aux
from prvrlab.losses.base import Loss
from prvrlab.models.base import ModelOutput
from prvrlab.registry import LOSSES

_KEYS = ("text_mu", "text_logvar", "video_mu", "video_logvar", "text_video")


def kl_gaussians(mu_a: Tensor, lv_a: Tensor, mu_b: Tensor, lv_b: Tensor) -> Tensor:
    """KL(N(mu_a, e^lv_a) || N(mu_b, e^lv_b)) of diagonal Gaussians, summed over the last dim."""
    return 0.5 * (lv_b - lv_a + (lv_a.exp() + (mu_a - mu_b) ** 2) * (-lv_b).exp() - 1.0).sum(dim=-1)


def kl_standard(mu: Tensor, lv: Tensor) -> Tensor:
    """KL(N(mu, e^lv) || N(0, I)), summed over the last dim."""
    return 0.5 * (lv.exp() + mu**2 - 1.0 - lv).sum(dim=-1)


@LOSSES.register("ral_da")
class RALDistributionAlignmentLoss(Loss):
    """KL(text || video) plus ``prior_weight`` x KL of each to N(0, I); see the module docstring."""

    def __init__(self, *, prior_weight: float = 1.0, plugin: str = "ral") -> None:
        super().__init__()
        self.prior_weight = check_number(prior_weight, "prior_weight", minimum=0.0)
        if not isinstance(plugin, str) or not plugin:
            raise ValueError(f"plugin must be a plug-in name, got {plugin!r}")
        self.plugin = plugin

    def required_aux(self) -> tuple[str, ...]:
        return tuple(f"{self.plugin}.{k}" for k in _KEYS)

    def forward(self, out: ModelOutput, batch: Batch, *, epoch: int) -> Tensor:
        t_mu, t_lv, v_mu, v_lv, text_video = plugin_aux(out, self.required_aux(), "ral_da")
        t_mu, t_lv, v_mu, v_lv = t_mu.float(), t_lv.float(), v_mu.float(), v_lv.float()
        if t_mu.shape[0] == 0:
            return t_mu.sum() * 0.0
        cross = kl_gaussians(t_mu, t_lv, v_mu[text_video], v_lv[text_video]).mean()
        prior = kl_standard(t_mu, t_lv).mean() + kl_standard(v_mu, v_lv).mean()
        return cross + self.prior_weight * prior
