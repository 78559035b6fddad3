"""Trial run names sort in start order: the number is zero-padded to the width of the trial count."""

from __future__ import annotations

from prvrlab.platform.search.names import SEP, search_run_name
from prvrlab.platform.search.study import StudyContext


def test_padded_names_sort_as_the_trials_started():
    names = [search_run_name(n, {"train.lr": 1e-3}, {"train.lr": "lr"}, digits=2) for n in range(1, 13)]
    assert names[0] == "trial 01" + SEP + "lr=1e-3" and names[11] == "trial 12" + SEP + "lr=1e-3"
    assert sorted(names) == names
    unpadded = [search_run_name(n, {}, {}) for n in range(1, 13)]
    assert unpadded[1] == "trial 2" and sorted(unpadded) != unpadded  # what the padding is for


def test_a_studys_run_names_use_its_width():
    study = StudyContext(kind="search", name="s", study_dir="/tmp/s", base_raw={}, metric="val/sumr", mode="max",
                         workers=1, cpus_per_worker=1.0, gpus_per_worker=0.0, tracking_uri="sqlite:///x.db",
                         experiment="e", trial_digits=3)
    assert study.run_name(7, {}) == "trial 007"
