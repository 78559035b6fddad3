"""Messages that name what went wrong: an empty ``--set <section>=`` is refused (it reset the whole
section to defaults, silently); a file given where a folder is wanted is called a file, not missing;
``recipes`` names ``--dir`` and where it looked; ``compare`` says a run is missing without MLflow's
exception class."""

from __future__ import annotations

import pytest

from prvrlab.data.bigfile import BigFile
from prvrlab.data.errors import DataError
from prvrlab.platform.cli import main
from prvrlab.platform.config import SECTIONS, ConfigError, parse_override


@pytest.mark.parametrize("empty", ["", "null", "~"])
@pytest.mark.parametrize("section", sorted(SECTIONS))
def test_an_empty_section_override_is_refused(section, empty):
    with pytest.raises(ConfigError, match=rf"--set {section}={empty}: an empty value would reset the whole '{section}' section"):
        parse_override(f"{section}={empty}")
    assert parse_override(f"{section}.x=") == (f"{section}.x", None)  # a key's empty value: as before


def test_a_file_is_not_called_missing(tmp_path, capsys):
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    assert main(["data", "inspect", "--root", str(plain)]) == 2
    assert capsys.readouterr().err == f"prvrlab: error: --root {plain}: {plain} is not a folder\n"
    with pytest.raises(DataError, match=rf"{plain}: not a folder; a BigFile is a folder"):
        BigFile(plain)


def test_recipes_names_the_option_and_where_it_looked(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["recipes"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("prvrlab: error: --dir configs: config folder not found") and f"relative to {tmp_path}" in err


def test_compare_says_a_run_is_missing_plainly(tmp_path, capsys):
    from prvrlab.platform.tracking.store import Tracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    Tracker(uri, "e")  # the store exists
    capsys.readouterr()  # MLflow's lines as it creates the store
    assert main(["compare", "deadbeef", "cafe", "--tracking-uri", uri]) == 2
    assert capsys.readouterr().err == f"prvrlab: error: run 'deadbeef' not found in {uri}\n"


def test_an_unknown_top_level_key_lists_the_top_level_keys():
    from prvrlab.platform.config import TOP_LEVEL, apply_overrides

    with pytest.raises(ConfigError) as caught:
        apply_overrides({}, {"foo.bar": 1})
    assert str(caught.value) == f"--set foo.bar: unknown key; 'foo' is not a top-level key ({', '.join(TOP_LEVEL)})"
    with pytest.raises(ConfigError, match=r"^--set trian\.lr: unknown key \(did you mean 'train'\?\)$"):
        apply_overrides({}, {"trian.lr": 1})
