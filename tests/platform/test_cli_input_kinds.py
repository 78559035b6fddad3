"""Options given the wrong kind of thing: one line naming the option, exit 2 (recipes --dir with a folder of no
configs had printed an empty catalogue and exit 0; a file was 'not found'; report --gallery without --profile
was silently ignored), and compare names the splits a run lacking --split's did log."""

from __future__ import annotations

from pathlib import Path

from prvrlab.platform.cli import EXIT_BAD_INPUT, main

REPO = Path(__file__).resolve().parents[2]


def test_recipes_dir_must_be_a_folder_holding_configs(tmp_path, capsys):
    assert main(["recipes", "--dir", str(tmp_path)]) == EXIT_BAD_INPUT
    assert f"--dir {tmp_path}: no configs (*.yaml) in it" in capsys.readouterr().err
    (tmp_path / "file.txt").write_text("x")
    assert main(["recipes", "--dir", str(tmp_path / "file.txt")]) == EXIT_BAD_INPUT
    assert "not a folder" in capsys.readouterr().err
    assert main(["recipes", "--dir", str(tmp_path / "nope")]) == EXIT_BAD_INPUT
    assert "config folder not found" in capsys.readouterr().err
    assert main(["recipes", "--dir", str(REPO / "configs")]) == 0


def test_report_gallery_needs_profile(capsys):
    assert main(["report", "--experiment", "x", "--gallery", "100"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.startswith("prvrlab: error: --gallery:") and "add --profile" in err


def test_compare_names_what_a_run_without_the_split_logged(monkeypatch):
    import pytest

    from prvrlab.reports import compare
    from prvrlab.reports.errors import ReportError

    sys_path = str(REPO / "tests" / "reports")
    monkeypatch.syspath_prepend(sys_path)
    from report_helpers import fake_run

    both = fake_run("a", 0, [1, 2, 3], split="test")
    both.metrics.update(fake_run("a", 0, [1, 2, 3], split="val").metrics)
    val_only = fake_run("b", 0, [1, 2, 3], split="val")
    monkeypatch.setattr(compare, "load_runs", lambda uri, ids: (None, [both, val_only], [[], []]))
    with pytest.raises(ReportError) as info:
        compare.compare_runs("sqlite:///x.db", ["a", "b"], split="test")
    assert str(info.value) == (
        "run 'b-seed0' logged no final test metrics (final/test/sumr); it logged: val; splits every run logged: val (--split)"
    )
