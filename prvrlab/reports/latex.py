"""The report's tables as LaTeX (booktabs), to paste into a paper: ``tables.tex`` beside ``report.md``.

Converts the markdown the report writes (:func:`~prvrlab.reports.tables.md_table`), so both files hold
the same numbers, bold cells and marks: every table under a ``##`` heading becomes a ``table``
environment captioned with that heading (``\\label{tab:<heading slug>}``, numbered when a section has
several), its columns aligned as in the markdown; the paragraph that follows a table (its legend) is
kept as a LaTeX comment above it.  The two-column key/value tables (empty header: the study's
metadata) are left out.  Needs ``\\usepackage{booktabs}`` and ``\\usepackage{amssymb}`` (``\\checkmark``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_ALIGN = {":--": "l", ":-:": "c", "--:": "r", "---": "l"}
_SPECIAL = {  # LaTeX's special characters in text mode
    "\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
    "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "|": r"\textbar{}",
    "<": r"\textless{}", ">": r"\textgreater{}",
}
_SYMBOLS = {  # the report's marks and symbols
    "±": r"$\pm$", "✓": r"\checkmark", "–": "--", "—": "---", "†": r"\textsuperscript{\dag}",
    "‡": r"\textsuperscript{\ddag}", "Δ": r"$\Delta$", "α": r"$\alpha$", "λ": r"$\lambda$", "γ": r"$\gamma$",
    "σ": r"$\sigma$", "×": r"$\times$", "≤": r"$\le$", "≥": r"$\ge$", "→": r"$\rightarrow$", "−": "$-$",
    "≈": r"$\approx$",
}
_INLINE = re.compile(r"\*\*(.+?)\*\*|(?<![\w*])\*(?!\s)(.+?)(?<!\s)\*(?![\w*])|`([^`]+)`")
_NEGATIVE = re.compile(r"(?<![\w.])-(?=\d)")  # a minus sign before a number: "-2.3", "[-3.9, +9.7]"


@dataclass
class Table:
    """One markdown table of a report: its section heading, column alignment, header, rows and legend."""

    heading: str
    align: list[str]
    header: list[str]
    rows: list[list[str]] = field(default_factory=list)
    legend: str = ""


def escape_text(text: str) -> str:
    """Plain text -> LaTeX text mode: special characters escaped, the report's symbols spelled in LaTeX."""
    out = "".join(_SPECIAL.get(ch, _SYMBOLS.get(ch, ch)) for ch in text)
    return _NEGATIVE.sub("$-$", out)


def cell_latex(cell: str) -> str:
    """A markdown cell (``**bold**``, ``*italic*``, ```code```, ``\\|``) -> LaTeX."""
    cell = cell.replace("\\|", "|")
    parts, last = [], 0
    for match in _INLINE.finditer(cell):
        parts.append(escape_text(cell[last:match.start()]))
        bold, italic, code = match.groups()
        if bold is not None:
            parts.append(rf"\textbf{{{cell_latex(bold)}}}")
        elif italic is not None:
            parts.append(rf"\textit{{{cell_latex(italic)}}}")
        else:
            parts.append(rf"\texttt{{{escape_text(code)}}}")
        last = match.end()
    parts.append(escape_text(cell[last:]))
    return "".join(parts)


def _cells(line: str) -> list[str]:
    """The cells of one markdown table line, ``\\|`` kept inside a cell."""
    cells = re.split(r"(?<!\\)\|", line.strip())
    return [c.strip() for c in cells[1:-1]]


def parse_tables(markdown: str) -> list[Table]:
    """The tables of a markdown text, each with its nearest ``#``-heading above and the paragraph after it."""
    lines = markdown.splitlines()
    tables: list[Table] = []
    heading, i = "", 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        is_table = line.startswith("|") and i + 1 < len(lines) and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", lines[i + 1].strip())
        if not is_table:
            i += 1
            continue
        table = Table(heading, [_ALIGN.get(m.strip(), "l") for m in _cells(lines[i + 1])], _cells(line))
        i += 2
        while i < len(lines) and lines[i].startswith("|"):
            table.rows.append(_cells(lines[i]))
            i += 1
        while i < len(lines) and not lines[i].strip():
            i += 1
        legend = []
        while i < len(lines) and lines[i].strip() and not lines[i].startswith(("#", "|", "![", "<sub>")):
            legend.append(lines[i].strip())
            i += 1
        table.legend = " ".join(legend)
        tables.append(table)
    return tables


def slug(text: str) -> str:
    """A label-safe form of a heading: 'Ablation (test)' -> 'ablation-test'."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "table"


def table_latex(table: Table, label: str) -> str:
    """One ``table`` environment (booktabs rules), its legend as comment lines above it."""
    out = [f"% {line}" for line in _wrap(table.legend)] if table.legend else []
    out += [
        r"\begin{table}[t]",
        r"\centering",
        rf"\caption{{{cell_latex(table.heading)}}}",
        rf"\label{{tab:{label}}}",
        rf"\begin{{tabular}}{{{''.join(table.align)}}}",
        r"\toprule",
        " & ".join(cell_latex(c) for c in table.header) + r" \\",
        r"\midrule",
        *(" & ".join(cell_latex(c) for c in row) + r" \\" for row in table.rows),
        r"\bottomrule",
        r"\end{tabular}",
        r"\end{table}",
    ]
    return "\n".join(out) + "\n"


def _wrap(text: str, width: int = 100) -> list[str]:
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return lines + ([line] if line else [])


def latex_tables(markdown: str, *, source: str = "") -> str:
    """Every table of a report's markdown but its key/value ones, as LaTeX (module docstring)."""
    tables = [t for t in parse_tables(markdown) if any(h for h in t.header)]
    counts: dict[str, int] = {}
    for t in tables:
        counts[slug(t.heading)] = counts.get(slug(t.heading), 0) + 1
    seen: dict[str, int] = {}
    parts = [f"% {line}" for line in _wrap(source)] if source else []
    parts.append(r"% Needs \usepackage{booktabs} and \usepackage{amssymb}.")
    for t in tables:
        base = slug(t.heading)
        seen[base] = seen.get(base, 0) + 1
        label = base if counts[base] == 1 else f"{base}-{seen[base]}"
        parts.append("")
        parts.append(table_latex(t, label).rstrip("\n"))
    return "\n".join(parts) + "\n"


__all__ = ["Table", "cell_latex", "escape_text", "latex_tables", "parse_tables", "slug", "table_latex"]
