"""An entry's runs whose distributions were logged with other bin edges: the edges most runs logged are kept
and the others named (the first run's edges had decided, and the rest were dropped without a word)."""

from __future__ import annotations

from prvrlab.reports.report import Doc, distribution_section, merged_distributions
from prvrlab.reports.source import TrialRun

ODD = [0.0, 0.5, 1.0]
COMMON = [0.0, 0.25, 0.5, 0.75, 1.0]
# seed -> (edges, counts, mean): seed 0, the first run, is the odd one out
LOGGED = {0: (ODD, [10, 0], 0.25), 1: (COMMON, [0, 0, 1, 3], 0.75), 2: (COMMON, [0, 1, 1, 2], 0.6)}


class Logged:
    """The part of a Study the section reads: each run's distribution records."""

    def distributions(self, run: TrialRun) -> dict:
        edges, counts, mean = LOGGED[run.seed]
        series = {"unpaired": {"counts": counts, "n": sum(counts), "mean": mean, "std": 0.1}}
        return {"arl.u": {"epoch": 2, "edges": edges, "series": series}}


RUNS = [TrialRun(f"r{s}", f"abl/probe/seed{s}", "FINISHED", s, {"prvrlab.variant": "probe", "prvrlab.seed": str(s)}, {}, {})
        for s in LOGGED]


def test_the_edges_most_runs_logged_are_kept_and_the_others_named(tmp_path):
    [(label, rec)] = merged_distributions(Logged(), [("probe", RUNS)])["arl.u"]
    kept = [s for s, (edges, _, _) in LOGGED.items() if edges == COMMON]
    n = sum(sum(LOGGED[s][1]) for s in kept)
    assert rec["edges"] == COMMON and rec["left_out"] == ["seed 0"]
    assert rec["series"]["unpaired"]["counts"] == [sum(LOGGED[s][1][i] for s in kept) for i in range(4)]
    assert rec["series"]["unpaired"]["n"] == n
    assert abs(rec["series"]["unpaired"]["sum"] / n - sum(LOGGED[s][2] * sum(LOGGED[s][1]) for s in kept) / n) < 1e-12
    doc = Doc(tmp_path)
    distribution_section(doc, Logged(), [("probe", RUNS)], "Variant")
    assert "Left out (bin edges other than those most runs of the variant logged" in doc.text()
    assert "probe: seed 0." in doc.text() and (tmp_path / "distribution_arl.u.png").is_file()


def test_a_tie_keeps_the_first_runs_edges_and_panels_of_other_edges_plot(tmp_path):
    [(_, rec)] = merged_distributions(Logged(), [("probe", RUNS[:2])])["arl.u"]
    assert rec["edges"] == ODD and rec["left_out"] == ["seed 1"]
    doc = Doc(tmp_path)  # one panel per entry, each with its own edges
    distribution_section(doc, Logged(), [("a", RUNS[:1]), ("b", RUNS[1:])], "Variant")
    assert "Left out" not in doc.text() and (tmp_path / "distribution_arl.u.png").is_file()
