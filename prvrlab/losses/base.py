"""The contract every loss fulfils."""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor

from prvrlab.data.batch import Batch
from prvrlab.models.base import ModelOutput
from prvrlab.models.component import Component


class Loss(Component):
    """A loss term: reads a ``ModelOutput`` and its ``Batch``, returns a scalar.

    Subclasses take only their own keyword-only hyperparameters; the weight of
    the term lives in :class:`prvrlab.losses.weighted.WeightedLoss`.  As a
    :class:`~prvrlab.models.component.Component` a loss declares what it
    needs from the backbone (``needs``), may own learnable parameters (they
    are optimised and checkpointed with the model), may act at epoch
    start/end and after each step, and may log metrics (``log_metric``).
    """

    # Its ``branch`` names query vectors it reads (``out.query.vectors``), not a branch's scores: it may then
    # also name a backbone's training-only batch vectors (``RetrievalModel.batch_vector_names``).
    reads_query_vectors: ClassVar[bool] = False
    # Boolean constructor parameters that switch parts of the term on/off (run tags and ablation
    # components list them as ``loss:<term>.<part>``; a term listing none is ``loss:<term>``).
    switch_params: ClassVar[tuple[str, ...]] = ()

    def required_aux(self) -> tuple[str, ...]:
        """``ModelOutput.aux`` keys this loss reads (plug-in outputs such as 'ral.text_mu');
        config validation checks that an enabled plug-in provides them."""
        return ()

    def forward(self, out: ModelOutput, batch: Batch, *, epoch: int) -> Tensor:
        raise NotImplementedError
