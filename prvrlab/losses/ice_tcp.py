"""L_tcp (papers/002, Sec. 3.5, Eq. 7): group-label cross-entropy of the ICE plug-in's TCP classifier.

Reads ``ice.tcp_logits`` (N, g), ``ice.tcp_labels`` (N,) and ``ice.tcp_part``
(N,): every position of every video, padding labelled -1 (ignored), part 2l
for the original and 2l + 1 for the shuffled sequence of level l
(video-level, moment-level; so at most 4 parts)::

    L_tcp = sum_l [ CE(p_o, y_o) + CE(p_s, y_s) ]     each CE the mean over its part's positions

(Eq. 7, summed over the levels the plug-in runs: "TCP is applied to both
the video-level branch and moment-level branch").
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from prvrlab.data.batch import Batch
from prvrlab.losses._common import plugin_aux
from prvrlab.losses.base import Loss
from prvrlab.models.base import ModelOutput
from prvrlab.registry import LOSSES


PARTS = 4  # Eq. 7: (video level, moment level) x (original, shuffled)


def part_cross_entropy(logits: Tensor, labels: Tensor, part: Tensor) -> Tensor:
    """Sum over parts of the mean cross-entropy of each part's rows whose label is not -1; (N, g), (N,), (N,) in
    [0, PARTS).  Sized by PARTS, not by the parts present, so the host never reads a count from the device."""
    ce = F.cross_entropy(logits.float(), labels, reduction="none", ignore_index=-1)  # (N,), 0 where ignored
    if ce.numel() == 0:
        return logits.float().sum() * 0.0
    sums = ce.new_zeros(PARTS).index_add(0, part, ce)  # (P,)
    counts = ce.new_zeros(PARTS).index_add(0, part, (labels >= 0).to(ce.dtype)).clamp(min=1)  # (P,)
    return (sums / counts).sum()


@LOSSES.register("ice_tcp")
class TCPLoss(Loss):
    """Eq. 7 on every level the ``ice`` plug-in's TCP part runs (no hyperparameter)."""

    def __init__(self) -> None:
        super().__init__()

    def required_aux(self) -> tuple[str, ...]:
        return ("ice.tcp_logits", "ice.tcp_labels", "ice.tcp_part")

    def forward(self, out: ModelOutput, batch: Batch, *, epoch: int) -> Tensor:
        logits, labels, part = plugin_aux(out, self.required_aux(), "ice_tcp")
        return part_cross_entropy(logits, labels, part)
