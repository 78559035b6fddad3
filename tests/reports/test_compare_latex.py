"""``prvrlab compare --latex``: the same table as the markdown, in LaTeX, printed and written by --out."""

from __future__ import annotations

import numpy as np

from prvrlab.platform.cli import main
from prvrlab.reports import compare
from prvrlab.reports.latex import latex_tables
from prvrlab.reports.source import TrialRun


def _runs(monkeypatch):
    def run(i: int) -> TrialRun:
        values = (("r1", 10.0 + i), ("r5", 20.0), ("r10", 30.0), ("r100", 60.0), ("sumr", 120.0 + i))
        metrics = {f"final/test/{m}": v for m, v in values}
        return TrialRun(f"run{i}aaaaaaaa", f"run_{i}", "FINISHED", 0, {}, {"data.collection": "synth"}, metrics)

    runs = [run(0), run(1)]
    rng = np.random.default_rng(0)
    ranks = {r.run_id: {"query_id": np.array([f"q{i}" for i in range(40)]), "rank": rng.integers(1, 50, 40)} for r in runs}
    monkeypatch.setattr(compare, "load_runs", lambda uri, ids: (None, runs, [[], []]))
    monkeypatch.setattr(compare, "run_ranks", lambda client, run_id, split, cache: ranks[run_id])
    return [r.run_id for r in runs]


def test_latex_is_the_markdown_table_converted(monkeypatch, tmp_path, capsys):
    ids = _runs(monkeypatch)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert main(["compare", *ids, "--tracking-uri", uri, "--bootstrap", "50"]) == 0
    markdown = capsys.readouterr().out
    out = tmp_path / "cmp.tex"
    assert main(["compare", *ids, "--tracking-uri", uri, "--bootstrap", "50", "--latex", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed == out.read_text()
    assert printed == latex_tables(markdown, source=f"prvrlab compare {' '.join(ids)} (bootstrap 50, seed 0)")
    assert r"\caption{Runs compared on test}" in printed and r"\label{tab:runs-compared-on-test}" in printed
    assert r"\texttt{run0aaaa} run\_0 (reference) & 10.0 & 20.0 & 30.0 & 60.0 & 120.0 &" in printed
