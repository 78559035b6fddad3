"""RAL proxy-matching loss L_PM: multi-instance NCE over proxies.

Reads the ``ral`` plug-in's proxies: text (T, P, D), video (B, P, D) (P = K
samples, K + 1 with the mean proxy, 1 without sampling) and ``text_video``
(T,).  Pos(r) = the proxies of r's video (all P x P pairs of a (support set,
video) pair are positive).

``formulation="official"`` (the official code's ``MILNCELoss_BoF``), with
s = raw dot product over the (T*P) x (B*P) matrix, no temperature::

    t2v_r = -mean_{c in Pos(r)} log_softmax_c s[r, c]
    loss  = (mean_r t2v_r + mean_c v2t_c) / 2      (v2t: the same over columns;
                                                    videos without a text unit left out)

``formulation="paper"`` (Eq. 10), with s = cos(r, c) / tau::

    t2v_r = logsumexp_c s[r, c] - logsumexp_{c in Pos(r)} s[r, c]
    loss  = mean_r t2v_r + (mean_c v2t_c when bidirectional)
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from prvrlab.data.batch import Batch
from prvrlab.checks import check_bool, check_choice, check_number
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


def proxy_matching_official(text: Tensor, video: Tensor, text_video: Tensor) -> Tensor:
    """Official L_PM of (T, P, D) text proxies against (B, P, D) video proxies: raw dots, both directions."""
    t, p, d = text.shape
    b, pv = video.shape[:2]
    if t == 0 or b == 0:
        return text.float().sum() * 0.0
    s = text.float().reshape(t * p, d) @ video.float().reshape(b * pv, d).t()  # (T*P, B*P')
    row_video = text_video.repeat_interleave(p)  # (T*P,)
    col_video = torch.arange(b, device=text.device).repeat_interleave(pv)  # (B*P',)
    pos = (row_video[:, None] == col_video[None, :]).float()  # (T*P, B*P')
    t2v = -(F.log_softmax(s, dim=1) * pos).sum(dim=1) / pos.sum(dim=1)  # (T*P,) every row has P' positives
    has = pos.sum(dim=0)  # (B*P',) positives per column, 0 for videos without a text unit
    v2t = -(F.log_softmax(s, dim=0) * pos).sum(dim=0) / has.clamp(min=1)  # (B*P',)
    v2t_mean = (v2t * (has > 0)).sum() / (has > 0).sum().clamp(min=1)
    return (t2v.mean() + v2t_mean) / 2


@LOSSES.register("ral_pm")
class RALProxyMatchingLoss(Loss):
    """Proxy matching; ``tau`` and ``bidirectional`` apply to ``formulation="paper"`` only (see the module docstring)."""

    corrected: ClassVar[dict[str, Any]] = {"formulation": "paper"}  # the `corrected` preset (docs/parity.md)
    applies_when: ClassVar[dict[str, dict[str, tuple[Any, ...]]]] = {
        "tau": {"formulation": ("paper",)}, "bidirectional": {"formulation": ("paper",)}
    }

    def __init__(
        self,
        *,
        formulation: Literal["paper", "official"] = "official",
        tau: float = 0.07,
        bidirectional: bool = False,
        plugin: str = "ral",
    ) -> None:
        super().__init__()
        self.formulation = check_choice(formulation, "formulation", ("paper", "official"))
        self.tau = check_number(tau, "tau", minimum=0.0, strict=True)
        self.bidirectional = check_bool(bidirectional, "bidirectional")
        if not isinstance(plugin, str) or not plugin:
            raise ValueError(f"plugin must be a plug-in name, got {plugin!r}")
        self.plugin = plugin

    def required_aux(self) -> tuple[str, ...]:
        return tuple(f"{self.plugin}.{k}" for k in ("text_proxies", "video_proxies", "text_video"))

    def forward(self, out: ModelOutput, batch: Batch, *, epoch: int) -> Tensor:
        text, video, text_video = plugin_aux(out, self.required_aux(), "ral_pm")
        if self.formulation == "official":
            return proxy_matching_official(text, video, text_video)
        return proxy_matching(text, video, text_video, tau=self.tau, bidirectional=self.bidirectional)
