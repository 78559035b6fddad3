"""The catalogue of shipped configs (``prvrlab recipes``, docs/recipes.md)."""

from __future__ import annotations

from pathlib import Path

import yaml

from prvrlab.platform.cli import EXIT_BAD_INPUT, main
from prvrlab.platform.recipes import catalogue, recipe, recipes

REPO = Path(__file__).resolve().parents[2]
CONFIG = {
    "model": {"name": "gmmformer", "hidden_size": 32},
    "losses": {"clip_triplet": {"loss": "triplet", "weight": 1.0, "branch": "clip"}},
    "eval": {"final_splits": ["val"]},
}


def write(path: Path, comment: str, raw: dict) -> Path:
    path.write_text("".join(f"# {line}\n" for line in comment.splitlines()) + yaml.safe_dump(raw))
    return path


def test_docs_recipes_is_the_catalogue_of_configs():
    """Regenerate with: prvrlab recipes > docs/recipes.md"""
    assert (REPO / "docs" / "recipes.md").read_text() == catalogue(REPO / "configs")


def test_the_kind_is_read_from_the_header(tmp_path):
    official = write(tmp_path / "a_tvr.yaml", "X on TVR: reproduces the official recipe.\n"
                     "Official source: github.com/someone/x @ 0123456789abcdef0123456789abcdef01234567", CONFIG)
    preset = write(tmp_path / "b_synth.yaml", "SYNTHETIC-DATA PRESET, NOT A REPRODUCTION", CONFIG)
    paper = write(tmp_path / "c.yaml", "the paper's setting; no official code", CONFIG)
    assert (recipe(official).kind, recipe(official).source) == ("official", "someone/x @ 0123456")
    assert (recipe(preset).kind, recipe(preset).source) == ("synthetic preset", "")
    assert recipe(paper).kind == "paper"


def test_an_extending_config_lists_its_parents_and_published_row(tmp_path):
    write(tmp_path / "base.yaml", "Official source: github.com/someone/x @ 0123456", CONFIG)
    child = write(tmp_path / "child.yaml", "paper only", {
        "extends": "base.yaml",
        "published": {"source": "Table 1", "split": "val", "r1": 1.0, "r5": 2.0, "r10": 3.0, "r100": 4.0, "sumr": 10.0},
    })
    entry = recipe(child)
    assert entry.kind == "paper" and entry.extends == ("base.yaml",)  # its own header, not its parent's
    assert entry.published == "val SumR 10.0 (Table 1)"
    assert [e.name for e in recipes(tmp_path)] == ["base", "child"]
    md = catalogue(tmp_path)
    assert "| `child` | `gmmformer` | – | paper | `base.yaml` | val SumR 10.0 (Table 1) |" in md
    assert "| `base` | `gmmformer` | – | official (someone/x @ 0123456) | – | – |" in md


def test_cli_prints_the_catalogue_and_names_a_missing_folder(tmp_path, capsys):
    write(tmp_path / "c.yaml", "paper", CONFIG)
    assert main(["recipes", "--dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out == catalogue(tmp_path)
    assert main(["recipes", "--dir", str(tmp_path / "nope")]) == EXIT_BAD_INPUT
    assert "config folder not found" in capsys.readouterr().err
