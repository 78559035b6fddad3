"""RAL proxy-matching loss L_PM (paper 000, Eq. 10): multi-instance InfoNCE over proxies.

Reads the ``ral`` plug-in's proxies: text (T, P, D), video (B, P, D) (P = K + 1:
the mean and K samples; P = 1 without sampling) and ``text_video`` (T,).
With s = cos(text proxy r, video proxy c) / tau over the (T*P) x (B*P)
matrix and Pos(r) = the P proxies of r's video (all P x P pairs of a
(support set, video) pair are positive)::

    t2v_r = logsumexp_c s[r, c] - logsumexp_{c in Pos(r)} s[r, c]
    loss  = mean_r t2v_r                                  (Eq. 10)
          + mean_c v2t_c   when bidirectional (same form over columns; videos
                           without a text unit are left out)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from prvrlab.data.batch import Batch
from prvrlab.checks import check_bool, check_number
from prvrlab.losses._common import plugin_aux
from prvrlab.losses.base import Loss
from prvrlab.models.base import ModelOutput
from prvrlab.registry import LOSSES


def proxy_matching(text: Tensor, video: Tensor, text_video: Tensor, *, tau: float, bidirectional: bool = False) -> Tensor:
    """Multi-instance InfoNCE of (T, P, D) text proxies against (B, P, D) video proxies."""
    t, p, d = text.shape
    b = video.shape[0]
    if t == 0 or b == 0:
        return text.float().sum() * 0.0
    tn = F.normalize(text.float().reshape(t * p, d), dim=-1, eps=1e-6)
    vn = F.normalize(video.float().reshape(b * video.shape[1], d), dim=-1, eps=1e-6)
    s = tn @ vn.t() / tau  # (T*P, B*P')
    row_video = text_video.repeat_interleave(p)  # (T*P,)
    col_video = torch.arange(b, device=text.device).repeat_interleave(video.shape[1])  # (B*P',)
    pos = row_video[:, None] == col_video[None, :]  # (T*P, B*P')
    neg_inf = torch.finfo(s.dtype).min
    t2v = torch.logsumexp(s, dim=1) - torch.logsumexp(s.masked_fill(~pos, neg_inf), dim=1)  # (T*P,)
    loss = t2v.mean()
    if bidirectional:
        has = pos.any(dim=0)  # (B*P',)
        v2t = torch.logsumexp(s, dim=0) - torch.logsumexp(s.masked_fill(~pos, neg_inf), dim=0)  # (B*P',)
        loss = loss + (v2t * has).sum() / has.sum().clamp(min=1)
    return loss


@LOSSES.register("ral_pm")
class RALProxyMatchingLoss(Loss):
    """Proxy matching with temperature ``tau``; see the module docstring."""

    def __init__(self, *, tau: float = 0.07, bidirectional: bool = False, plugin: str = "ral") -> None:
        super().__init__()
        self.tau = check_number(tau, "tau", minimum=0.0, strict=True)
        self.bidirectional = check_bool(bidirectional, "bidirectional")
        if not isinstance(plugin, str) or not plugin:
            raise ValueError(f"plugin must be a plug-in name, got {plugin!r}")
        self.plugin = plugin

    def required_aux(self) -> tuple[str, ...]:
        return tuple(f"{self.plugin}.{k}" for k in ("text_proxies", "video_proxies", "text_video"))

    def forward(self, out: ModelOutput, batch: Batch, *, epoch: int) -> Tensor:
        text, video, text_video = plugin_aux(out, self.required_aux(), "ral_pm")
        return proxy_matching(text, video, text_video, tau=self.tau, bidirectional=self.bidirectional)
