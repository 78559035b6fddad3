"""Where a collection's files are and how its features are preprocessed (the ``data:`` config section).

Defined here, in the data layer, so that readers and loaders need nothing from
the platform; :mod:`prvrlab.platform.config` validates it with the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from prvrlab.checks import check_choice, check_int, check_positive_int
from prvrlab.data.preprocess import LAST_BIN_CHOICES, NORMALIZE_CHOICES


MAX_LENGTH = 1 << 20  # frames, clips or query tokens of one item


@dataclass
class DataConfig:
    """Where the features are and how they are preprocessed."""

    root: str = "data/synth"  # folder holding FeatureData/ and TextData/, or its parent holding <collection>/
    collection: str = "synth"  # tvr | activitynet | charades | synth (file name prefix)
    visual_feature: str | None = None  # FeatureData/<name> BigFile folder or .hdf5 file; None: the only one there
    text_feature: str | None = None  # default: TextData/roberta_<collection>_query_feat.hdf5
    train_split: str = "train"
    val_split: str = "val"
    test_split: str | None = "test"
    max_frames: int = 128
    num_clips: int = 32
    max_query_len: int = 30
    last_bin: Literal["official", "inclusive"] = "official"  # official drops the final frame of a multi-frame last bin
    normalize: Literal["official", "exact"] = "official"  # official: rows / (L2 norm + 1e-5); exact: / L2 norm
    synthesize: str | None = None  # synthetic preset written to `root` when it is missing
    synth_seed: int = 0
    loader_workers: int = 0
    resident: bool = False  # hold the training and validation splits, preprocessed, on the training device; batch there
    pin_memory: bool | None = None  # page-locked training batches (faster copies to a GPU); None: on when training on CUDA

    def check(self) -> None:
        """A ValueError naming the ``data.<key>`` that is out of range."""
        for name in ("max_frames", "num_clips", "max_query_len"):
            value = check_positive_int(getattr(self, name), f"data.{name}")
            if value > MAX_LENGTH:  # a typo's 10**20 had failed inside the run: numpy and torch refuse such sizes
                raise ValueError(f"data.{name} must be at most {MAX_LENGTH}, got {value!r}")
        check_int(self.synth_seed, "data.synth_seed", minimum=0)
        check_choice(self.last_bin, "data.last_bin", LAST_BIN_CHOICES)
        check_choice(self.normalize, "data.normalize", NORMALIZE_CHOICES)
        check_int(self.loader_workers, "data.loader_workers", minimum=0)
