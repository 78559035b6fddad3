"""``prvrlab report`` logs what it wrote, not its whole ``--out`` folder: a folder shared with another study's
report or a user's files (``--out .`` would have uploaded the working folder, mlflow.db included) had all of it
logged as the parent run's ``report/`` artifact."""

from __future__ import annotations

import contextlib

from prvrlab.reports import report as report_module
from prvrlab.reports.report import figures_of, report, report_files

from report_helpers import fake_run, fake_study


class Recorder:
    def __init__(self):
        self.logged: list[tuple[str, str, str]] = []

    def log_artifact(self, run_id, local_path, artifact_path=None):
        self.logged.append((run_id, local_path, artifact_path))


def test_only_the_report_its_tables_and_its_figures_are_logged(tmp_path, monkeypatch):
    study = fake_study([fake_run(v, 0, [1, 2, 3]) for v in ("base", "other")], {}, baseline="base", seeds=[0])
    study.client = Recorder()
    monkeypatch.setattr(report_module, "load_study", lambda uri, parent: contextlib.nullcontext(study))
    out = tmp_path / "shared"
    out.mkdir()
    (out / "notes_private.txt").write_text("mine")
    (out / "sensitivity_train.lr.png").write_bytes(b"another study's figure")
    (out / "mlflow.db").write_bytes(b"")
    path = report(tracking_uri="sqlite:///unused.db", parent_id="parent", out=out)
    logged = {(p.split("/")[-1], a) for _, p, a in study.client.logged}
    expected = {("report.md", "report"), ("tables.tex", "report")} | {(f, "report") for f in figures_of(path)}
    assert logged == expected
    assert {run for run, _, _ in study.client.logged} == {"parent"}
    assert set(report_files(path)) == {"report.md", "tables.tex", *figures_of(path)}


def test_a_linked_file_outside_the_folder_is_not_logged(tmp_path):
    out = tmp_path / "r"
    out.mkdir()
    (tmp_path / "secret.png").write_bytes(b"x")
    (out / "fig.png").write_bytes(b"x")
    (out / "report.md").write_text("![a](fig.png)\n![b](../secret.png)\n![c](missing.png)\n")
    assert report_files(out / "report.md") == ["report.md", "fig.png"]
