"""The report's tables as LaTeX (booktabs), to paste into a paper: ``tables.tex`` beside ``report.md``.

Converts the markdown the report writes (:func:`~prvrlab.reports.tables.md_table`), so both files hold
the same numbers, bold cells and marks.  Every table becomes a ``table`` environment, its columns
aligned as in the markdown, captioned with its section's heading and, where a short paragraph right
before it names it (a sensitivity table's key), that paragraph too (``\\label{tab:<caption slug>}``,
numbered where several are the same); the report's other paragraphs around it (its legend) are kept as
LaTeX comments above it.  A key/value table (empty header) has no header row; the study's summary under
the report's title is left out.  Needs ``\\usepackage{booktabs}`` and ``\\usepackage{amssymb}``
(``\\checkmark``).
"""

from __future__ import annotations

import re
import textwrap
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
    "≈": r"$\approx$", "·": r"$\cdot$", "…": r"\ldots{}", "µ": r"$\mu$", "∈": r"$\in$", "∞": r"$\infty$",
    "≠": r"$\neq$", "²": r"\textsuperscript{2}",
}
INTRO_MAX = 160  # a paragraph right before a table this short names it (its caption's second part)


_INLINE = re.compile(r"\*\*(.+?)\*\*|(?<![\w*])\*(?!\s)(.+?)(?<!\s)\*(?![\w*])|`([^`]+)`")
_NEGATIVE = re.compile(r"(?<![\w.])-(?=\d)")  # a minus sign before a number: "-2.3", "[-3.9, +9.7]"


@dataclass
class Table:
    """One markdown table of a report: its section heading (and level), column alignment, header, rows, the
    short paragraph that names it (``intro``, e.g. a sensitivity table's key), and the paragraphs around it
    (``notes``: those before it but the intro, then its legend after it)."""

    heading: str
    level: int
    align: list[str]
    header: list[str]
    rows: list[list[str]] = field(default_factory=list)
    intro: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def key_value(self) -> bool:
        """A two-column key/value table (its header empty)."""
        return not any(self.header)

    @property
    def caption(self) -> str:
        return f"{self.heading}: {self.intro}" if self.intro else self.heading


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


def _blocks(markdown: str) -> list[tuple[str, object]]:
    """The markdown as ("heading", (level, text)), ("table", (align, header, rows)), ("para", text) and
    ("other", text) blocks (figures, the ``<sub>`` footer)."""
    lines = markdown.splitlines()
    blocks: list[tuple[str, object]] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.strip():
            i += 1
        elif line.startswith("#"):
            blocks.append(("heading", (len(line) - len(line.lstrip("#")), line.lstrip("#").strip())))
            i += 1
        elif line.startswith("|") and i + 1 < len(lines) and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", lines[i + 1].strip()):
            align, header, rows = [_ALIGN.get(m.strip(), "l") for m in _cells(lines[i + 1])], _cells(line), []
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(_cells(lines[i]))
                i += 1
            blocks.append(("table", (align, header, rows)))
        elif line.startswith(("![", "<sub>")):
            blocks.append(("other", line))
            i += 1
        else:
            text = []
            while i < len(lines) and lines[i].strip() and not lines[i].startswith(("#", "|", "![", "<sub>")):
                text.append(lines[i].strip())
                i += 1
            blocks.append(("para", " ".join(text)))
    return blocks


def _legend(blocks: list[tuple[str, object]], n: int) -> list[int]:
    """The indices of the paragraphs after the table at ``n`` that are its legend: up to the next heading, or
    up to the next table but the short paragraph right before it (that table's intro)."""
    found = []
    for m in range(n + 1, len(blocks)):
        kind, value = blocks[m]
        if kind == "table" and found and found[-1] == m - 1 and len(blocks[m - 1][1]) <= INTRO_MAX:
            found.pop()
        if kind in ("heading", "table"):
            break
        if kind == "para":
            found.append(m)
    return found


def parse_tables(markdown: str) -> list[Table]:
    """The tables of a markdown text, each with its nearest heading above, the short paragraph right before it
    that names it (at most :data:`INTRO_MAX` characters), the other paragraphs since the previous table or
    heading, and its legend (:func:`_legend`)."""
    blocks = _blocks(markdown)
    tables: list[Table] = []
    heading, level, pending, legends = "", 0, [], set()
    for n, (kind, value) in enumerate(blocks):
        if kind == "heading":
            level, heading = value
            pending = []
        elif kind == "para" and n not in legends:
            pending.append(value)
        elif kind == "table":
            align, header, rows = value
            last = pending[-1] if pending and blocks[n - 1][0] == "para" else ""
            intro = pending.pop() if last and len(last) <= INTRO_MAX else ""
            legend = _legend(blocks, n)
            legends.update(legend)
            tables.append(Table(heading, level, align, header, rows, intro, [*pending, *(blocks[m][1] for m in legend)]))
            pending = []
    return tables


def slug(text: str) -> str:
    """A label-safe form of a heading: 'Ablation (test)' -> 'ablation-test'."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "table"


def _row(cells: list[str]) -> str:
    """One tabular row; a first cell starting with '[' is shielded by an empty group (``\\`` and booktabs'
    rules would read it as their optional argument)."""
    text = " & ".join(cell_latex(c) for c in cells)
    return ("{}" + text if text.startswith("[") else text) + r" \\"


def table_latex(table: Table, label: str) -> str:
    """One ``table`` environment (booktabs rules; a key/value table without a header row), the paragraphs
    around it in the report as comment lines above it."""
    out = [f"% {line}" for note in table.notes for line in _wrap(note)]
    out += [
        r"\begin{table}[t]",
        r"\centering",
        rf"\caption{{{cell_latex(table.caption)}}}",
        rf"\label{{tab:{label}}}",
        rf"\begin{{tabular}}{{{''.join(table.align)}}}",
        r"\toprule",
        *([] if table.key_value else [_row(table.header), r"\midrule"]),
        *(_row(row) for row in table.rows),
        r"\bottomrule",
        r"\end{tabular}",
        r"\end{table}",
    ]
    return "\n".join(out) + "\n"


def _wrap(text: str) -> list[str]:
    """Comment lines of at most 100 characters, words kept whole."""
    return textwrap.wrap(text, 100, break_long_words=False, break_on_hyphens=False)


def latex_tables(markdown: str, *, source: str = "") -> str:
    """Every table of a report's markdown as LaTeX, but the key/value summary under its title (module
    docstring); labels from the captions, numbered where several are the same."""
    tables = [t for t in parse_tables(markdown) if not (t.key_value and t.level == 1)]
    counts: dict[str, int] = {}
    for t in tables:
        counts[slug(t.caption)] = counts.get(slug(t.caption), 0) + 1
    seen: dict[str, int] = {}
    parts = [f"% {line}" for line in _wrap(source)] if source else []
    parts.append(r"% Needs \usepackage{booktabs} and \usepackage{amssymb}.")
    for t in tables:
        base = slug(t.caption)
        seen[base] = seen.get(base, 0) + 1
        label = base if counts[base] == 1 else f"{base}-{seen[base]}"
        parts.append("")
        parts.append(table_latex(t, label).rstrip("\n"))
    return "\n".join(parts) + "\n"


__all__ = ["Table", "cell_latex", "escape_text", "latex_tables", "parse_tables", "slug", "table_latex"]
