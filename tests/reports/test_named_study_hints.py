"""A misspelt experiment or study name given to ``report`` (or in its spec) gets the closest one and the list of what there is."""

from __future__ import annotations

import pytest

from prvrlab.platform.cli import main
from prvrlab.reports.errors import ReportError
from prvrlab.reports.source import find_parent


def test_a_misspelt_experiment_names_the_closest_and_lists_them(studies, capsys):
    code = main(["report", "--experiment", "test", "--tracking-uri", studies["uri"], "--no-log"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "unknown experiment 'test'" in err and "(did you mean 'tests'?)" in err
    assert err.rstrip().split("; experiments: ", 1)[1].split(", ") == sorted(["Default", "tests"])


def test_a_misspelt_study_names_the_closest_of_that_experiment(studies):
    """(``report --spec``'s path: the spec names the experiment and the study.)"""
    with pytest.raises(ReportError) as err:
        find_parent(tracking_uri=studies["uri"], experiment="tests", study="srhc")
    message = str(err.value)
    assert "no search or ablation named 'srhc'" in message and "(did you mean 'srch'?)" in message
    assert message.endswith("its studies: abl, srch")


def test_a_study_under_an_unknown_experiment_blames_the_experiment(studies):
    with pytest.raises(ReportError) as err:
        find_parent(tracking_uri=studies["uri"], experiment="nope", study="srch")
    assert "unknown experiment 'nope'" in str(err.value) and "named 'srch'" not in str(err.value)
