"""Names taken from the tracking store never lead a report's files out of their folder."""

from __future__ import annotations

import contextlib

from prvrlab.reports import plots, report as report_module
from prvrlab.reports.report import report

from report_helpers import fake_run, fake_study


def test_names_of_dots_alone_are_not_folders():
    assert plots.safe_name("..") == "__" and plots.safe_name(".") == "_" and plots.safe_name("") == "_"
    assert plots.safe_name("../x") == ".._x" and plots.safe_name("a/../b") == "a_.._b"
    assert plots.safe_name("losses.qd.weight") == "losses.qd.weight" and plots.safe_name("..x") == "..x"


def test_a_study_named_dot_dot_is_reported_under_results_reports(tmp_path, monkeypatch):
    """The default folder is results/reports/<study name>: a store tagging a study '..' must not turn it into
    results/ (which the report would then log, checkpoints and all, as the parent run's artifact)."""
    study = fake_study([fake_run(v, 0, [1, 2, 3]) for v in ("base", "other")], {}, baseline="base", seeds=[0])
    study.name = ".."
    monkeypatch.setattr(report_module, "load_study", lambda uri, parent: contextlib.nullcontext(study))
    monkeypatch.chdir(tmp_path)
    path = report(tracking_uri="sqlite:///unused.db", parent_id="parent", log_artifact=False)
    assert path.resolve() == (tmp_path / "results" / "reports" / "__" / "report.md").resolve()
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == ["reports"]
