"""``prvrlab report --run-id <a trial's run>`` reports the trial's study and says so (it did silently, and
logged the report to the parent)."""

from __future__ import annotations

from pathlib import Path

from prvrlab.platform import cli
from prvrlab.reports import report as report_module


def test_a_trial_run_id_says_which_study_is_reported(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "_report_parent", lambda args: ("sqlite:///x.db", "parent0"))
    written = tmp_path / "report.md"
    written.write_text("# r\n")
    monkeypatch.setattr(report_module, "report", lambda **kw: Path(written))
    assert cli.main(["report", "--run-id", "trial7", "--no-log"]) == 0
    assert "run trial7 is a trial of the study of parent run parent0: reporting that study" in capsys.readouterr().out
    assert cli.main(["report", "--run-id", "parent0", "--no-log"]) == 0
    assert "is a trial" not in capsys.readouterr().out
