"""prvrlab: a Ray-distributed hyperparameter and ablation platform for PRVR."""

__version__ = "0.1.0"
