"""The report's tables in LaTeX (tables.tex): a worked conversion, and every table of real reports."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from prvrlab.reports.latex import cell_latex, escape_text, latex_tables, parse_tables
from prvrlab.reports.report import LATEX_FILE, Options, write_report, written_text

from report_helpers import fake_run, fake_study

REPO = Path(__file__).resolve().parents[2]

WORKED = """# Ablation: demo

|  |  |
|:--|:--|
| **Parent run** | `abc` |

## Ablation (test)

| Variant | loss_a | R@1 | ΔSumR |
|:--|:-:|--:|--:|
| base (baseline) | – | 7.8 ± 1.1 | — |
| a\\|b | ✓ | **9.3 ± 1.1** | -2.3 † ‡ |
| c | ✓ | *failed* | `x_y` |

Mean ± std over seeds; 100% of R@K.
A second line of the same paragraph.

![a figure](f.png)

Another note of the section.

## Sensitivity (val)

Runs: the runs with final metrics, which the means are over; this paragraph is longer than a table's name can be, so it stays a note.

**train.lr** (binned)

| train.lr | Runs |
|:--|--:|
| [0.001, 0.002) | 2 |

**loss.w**

| loss.w | Runs |
|:--|--:|
| 0 · 1 | 1 |

## Best trial

|  |  |
|:--|:--|
| **Trial** | `t1` |

<sub>footer</sub>
"""

EXPECTED = r"""% made by hand
% Needs \usepackage{booktabs} and \usepackage{amssymb}.

% Mean ± std over seeds; 100% of R@K. A second line of the same paragraph.
% Another note of the section.
\begin{table}[t]
\centering
\caption{Ablation (test)}
\label{tab:ablation-test}
\begin{tabular}{lcrr}
\toprule
Variant & loss\_a & R@1 & $\Delta$SumR \\
\midrule
base (baseline) & -- & 7.8 $\pm$ 1.1 & --- \\
a\textbar{}b & \checkmark & \textbf{9.3 $\pm$ 1.1} & $-$2.3 \textsuperscript{\dag} \textsuperscript{\ddag} \\
c & \checkmark & \textit{failed} & \texttt{x\_y} \\
\bottomrule
\end{tabular}
\end{table}

% Runs: the runs with final metrics, which the means are over; this paragraph is longer than a table's
% name can be, so it stays a note.
\begin{table}[t]
\centering
\caption{Sensitivity (val): \textbf{train.lr} (binned)}
\label{tab:sensitivity-val-train-lr-binned}
\begin{tabular}{lr}
\toprule
train.lr & Runs \\
\midrule
{}[0.001, 0.002) & 2 \\
\bottomrule
\end{tabular}
\end{table}

\begin{table}[t]
\centering
\caption{Sensitivity (val): \textbf{loss.w}}
\label{tab:sensitivity-val-loss-w}
\begin{tabular}{lr}
\toprule
loss.w & Runs \\
\midrule
0 $\cdot$ 1 & 1 \\
\bottomrule
\end{tabular}
\end{table}

\begin{table}[t]
\centering
\caption{Best trial}
\label{tab:best-trial}
\begin{tabular}{ll}
\toprule
\textbf{Trial} & \texttt{t1} \\
\bottomrule
\end{tabular}
\end{table}
"""


def test_worked_report_converts_as_written_by_hand():
    assert latex_tables(WORKED, source="made by hand") == EXPECTED


def test_cells_escape_latex_and_keep_words_and_dates():
    assert escape_text("a_b & c% #1 {x} ~^\\") == r"a\_b \& c\% \#1 \{x\} \textasciitilde{}\textasciicircum{}\textbackslash{}"
    assert escape_text("[-3.9, +9.7] 2026-12-07 n-1 −4") == "[$-$3.9, +9.7] 2026-12-07 n-1 $-$4"
    assert cell_latex("**+7.0 †**") == r"\textbf{+7.0 \textsuperscript{\dag}}"
    assert cell_latex("2*3*4 and *note*") == r"2*3*4 and \textit{note}"


def _columns(row: str) -> int:
    return len(re.findall(r"(?<!\\)&", row)) + 1


@pytest.mark.parametrize("report", sorted(p.relative_to(REPO).as_posix() for p in REPO.glob("docs/*/report.md")))
def test_every_table_of_the_shipped_reports(report):
    """Each non-metadata markdown table becomes one tabular with as many cells per row as columns, balanced
    braces and no character LaTeX would read as markup left unescaped."""
    md = (REPO / report).read_text(encoding="utf-8")
    tables = [t for t in parse_tables(md) if not (t.key_value and t.level == 1)]
    markdown_tables = sum(1 for a, b in zip(md.splitlines(), md.splitlines()[1:]) if a.startswith("| ") and b.startswith("|:"))
    assert len(tables) == markdown_tables - 1  # the key/value summary under the title is left out
    tex = latex_tables(md)
    body = [line for line in tex.splitlines() if not line.startswith("%")]
    assert sum(line.startswith(r"\begin{tabular}") for line in body) == len(tables)
    spec = None
    for line in body:
        if line.startswith(r"\begin{tabular}"):
            spec = line[len(r"\begin{tabular}{") : -1]
        elif line.endswith(r" \\"):
            assert _columns(line) == len(spec), line
            assert not line.startswith("["), line  # a row's '[' would be read as an optional argument
        text = re.sub(r"\\[{}%&#_$]", "", line)
        assert text.count("{") == text.count("}"), line
        assert not re.search(r"[%#_]", text), line
        assert all(ord(ch) < 128 for ch in line), line
    labels = re.findall(r"\\label\{([^}]+)\}", tex)
    assert len(labels) == len(set(labels)) == len(tables)


def test_write_report_writes_the_tables_beside_the_markdown(tmp_path):
    runs = [fake_run(v, s, [1, 3, 12, 2]) for v in ("base", "other") for s in (0, 1)]
    study = fake_study(runs, {}, baseline="base", seeds=[0, 1])
    path = write_report(study, tmp_path, Options(n_boot=50))
    tex = (tmp_path / LATEX_FILE).read_text(encoding="utf-8")
    head, tables = tex.split("amssymb}.\n", 1)
    assert tables == latex_tables(path.read_text(encoding="utf-8")).split("amssymb}.\n", 1)[1]
    assert "% Generated by prvrlab report from MLflow experiment 0, parent run parent;" in head
    assert r"\caption{Ablation (test)}" in tex and "base (baseline) &" in tex
    assert f"`{LATEX_FILE}`" in path.read_text(encoding="utf-8")
    assert written_text(path) == f"{path} and no figure, with its tables in LaTeX ({LATEX_FILE})"


def test_binned_sensitivity_tables_of_a_search_are_named_and_their_rows_shielded(tmp_path):
    """A float key's sensitivity table bins its values into '[lo, hi)' rows: in LaTeX each such row starts
    with an empty group, and each table is captioned with its key (the line the report prints above it)."""
    from prvrlab.reports.report import Doc, sensitivity_section
    from prvrlab.reports.source import TrialRun

    def trial(i: int, lr: float) -> TrialRun:
        metrics = {f"final/val/{m}": v for m, v in {"r1": 1.0, "r5": 2.0, "r10": 3.0, "r100": 100.0, "sumr": 100.0 + i}.items()}
        return TrialRun(f"r{i}", f"r{i}", "FINISHED", 0, {"prvrlab.status": "finished"}, {}, metrics)

    doc = Doc(tmp_path)
    lrs = [1e-4 * 1.5**i for i in range(12)]
    sensitivity_section(doc, {"train.lr": [(lr, trial(i, lr)) for i, lr in enumerate(lrs)]},
                        {"train.lr": {"loguniform": [1e-4, 1e-2]}}, "val")
    md = doc.text()
    assert "\n| [" in md  # the markdown's binned rows
    tex = latex_tables(md)
    rows = [line for line in tex.splitlines() if line.endswith(r" \\") and not line.startswith("train.lr")]
    assert rows and all(line.startswith("{}[") for line in rows)
    assert r"\caption{Sensitivity (val): \textbf{train.lr} (binned, log scale)}" in tex
