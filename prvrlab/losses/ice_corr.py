"""L_ice (papers/002, Sec. 3.3): align the ICE plug-in's mined pseudo-positive (moment, text) pairs.

The n_c mutually-nearest pairs above the correlation threshold
(``ice.pair_moment``, ``ice.pair_query``, (n_c, D)) form a mini-batch
trained like the base model (Eq. 3)::

    L_ice = L^trip + nce_weight * L^nce      over the n_c x n_c text-moment matrix, diagonal positive

The paper does not give the balance inside L_ice; ``nce_weight`` defaults
to 0.04, the base model's moment-level lambda_2 (the pairs are moment-text
pairs).  The triplet part uses the single hardest in-batch negative from
epoch ``hard_negative_start_epoch`` on (a uniform one before): the base
loss's schedule, not its choice (it draws among its ``hard_pool_size``
hardest).  No pair, or one: 0 (no negative), still attached to the graph.

``own_video`` (the paper says only that the pairs "form a mini-batch of
size n_c" aligned "using contrastive learning losses"): ``negative``, the
default, takes that literally: every other pair's moment is a negative of a
text, also a moment of the text's own video, which L_base pulls towards it
(and every other pair's text a negative of a moment, also a text of the
moment's video). ``ignore`` leaves those entries out of both terms: a
text's own-video moments and a moment's own-video texts are neither
positive nor negative.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from torch import Tensor

from prvrlab.checks import check_choice, check_number
from prvrlab.data.batch import Batch
from prvrlab.losses._common import plugin_aux
from prvrlab.losses._ice import paired_contrastive, pair_triplet
from prvrlab.losses.base import Loss
from prvrlab.models.base import ModelOutput
from prvrlab.registry import LOSSES


OWN_VIDEO = ("negative", "ignore")


@LOSSES.register("ice_corr")
class ICECorrelationLoss(Loss):
    """Triplet + ``nce_weight`` x InfoNCE over the mined pseudo-positive pairs (see the module docstring)."""

    hash_neutral: ClassVar[dict[str, Any]] = {"own_video": "negative"}  # added in session 62

    def __init__(
        self,
        *,
        margin: float = 0.1,
        nce_weight: float = 0.04,
        hard_negative_start_epoch: int = 20,
        own_video: Literal["negative", "ignore"] = "negative",
    ) -> None:
        super().__init__()
        self.nce_weight = check_number(nce_weight, "nce_weight", minimum=0.0)
        self.triplet = pair_triplet(margin=margin, hard_negative_start_epoch=hard_negative_start_epoch)
        self.own_video = check_choice(own_video, "own_video", OWN_VIDEO)

    def required_aux(self) -> tuple[str, ...]:
        pairs = ("ice.pair_query", "ice.pair_moment")
        return pairs + (("ice.pair_text", "ice.pair_video") if self.own_video == "ignore" else ())

    def forward(self, out: ModelOutput, batch: Batch, *, epoch: int) -> Tensor:
        found = plugin_aux(out, self.required_aux(), "ice_corr")
        texts, moments = found[:2]  # (n_c, D) each
        if self.own_video == "negative":
            return paired_contrastive(texts, moments, self.triplet, self.nce_weight, epoch=epoch)
        text_row, moment_video = found[2:]  # (n_c,) each: the text's query row, the moment's video row
        text_video = batch.query_video.to(text_row.device)[text_row]  # (n_c,)
        return paired_contrastive(
            texts, moments, self.triplet, self.nce_weight, epoch=epoch, anchor_group=text_video, target_group=moment_video
        )
