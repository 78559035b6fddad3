"""Reading a study's saved Tune state before a resume keeps Tune's warnings (a trial with no results yet)
off the console: they go to the study's ``study.log``, as the search's own do."""

from __future__ import annotations

import logging

import ray.tune

from prvrlab.platform.search.tuning import ended_trials


def test_tunes_warnings_while_reading_the_state_go_to_the_study_log(tmp_path, monkeypatch):
    class Analysis:
        def __init__(self, path):
            logging.getLogger("ray.tune.analysis.experiment_analysis").warning("Failed to fetch metrics for 1 trial(s)")
            self.trials = []

    monkeypatch.setattr(ray.tune, "ExperimentAnalysis", Analysis)
    (tmp_path / "tune").mkdir()
    assert ended_trials(tmp_path, 3) is None  # no trial yet: Tune's path decides
    assert "Failed to fetch metrics for 1 trial(s)" in (tmp_path / "study.log").read_text()
