"""Missing inputs are named with what is there: the closest YAML file beside a misspelled config or spec, the
closest synthetic preset, and for a data root that does not exist (or holds no TextData) that fact, not a
caption-file pattern."""

from __future__ import annotations

import pytest

from prvrlab.platform.cli import EXIT_BAD_INPUT, main


def _error(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("prvrlab: error: "), err
    return err[0][len("prvrlab: error: "):]


@pytest.mark.parametrize("command, what", [(["train"], "config file"), (["search"], "spec file"), (["ablate"], "spec file")])
def test_a_misspelled_yaml_file_names_the_closest_one_beside_it(tmp_path, capsys, command, what):
    (tmp_path / "gmmformer_synth_tiny.yaml").write_text("name: x\n")
    (tmp_path / "mssl_tvr.yaml").write_text("name: y\n")
    (tmp_path / "gmmformer_synth_tny.txt").write_text("not yaml")
    missing = tmp_path / "gmmformer_synth_tny.yaml"
    assert main([*command, str(missing), "--check"]) == EXIT_BAD_INPUT
    assert _error(capsys) == f"{what} not found: {missing} (did you mean '{tmp_path / 'gmmformer_synth_tiny.yaml'}'?)"
    unlike = tmp_path / "zzzz.yaml"
    assert main([*command, str(unlike), "--check"]) == EXIT_BAD_INPUT
    assert _error(capsys) == f"{what} not found: {unlike}"


def test_a_misspelled_synthetic_preset_names_the_closest(tmp_path, capsys):
    assert main(["data", "synth", "--preset", "smal", "--out", str(tmp_path / "s")]) == EXIT_BAD_INPUT
    assert _error(capsys).startswith("unknown synthetic preset 'smal' (did you mean 'small'?); known: tiny, small")
    assert main(["data", "synth", "--preset", "tiny-skwed", "--out", str(tmp_path / "s")]) == EXIT_BAD_INPUT
    assert "(did you mean 'tiny-skewed'?)" in _error(capsys)
    assert not (tmp_path / "s").exists()


def test_data_inspect_of_a_root_that_does_not_exist_says_so(tmp_path, capsys):
    root = tmp_path / "nowhere"
    assert main(["data", "inspect", "--root", str(root)]) == EXIT_BAD_INPUT
    assert _error(capsys) == f"--root {root}: not found: {root} (prvrlab data synth --out {root} writes a synthetic collection there)"
    assert main(["data", "inspect", "--root", str(root), "--collection", "tvr"]) == EXIT_BAD_INPUT
    assert _error(capsys) == f"--root {root}: not found: {root}"


def test_data_timestamps_names_a_missing_root_a_missing_text_folder_and_the_caption_files_there(tmp_path, capsys):
    annotations = tmp_path / "tvr_val_release.jsonl"
    annotations.write_text("")
    args = ["data", "timestamps", str(annotations), "--format", "tvr", "--collection", "tvr", "--split", "val", "--root"]
    root = tmp_path / "data" / "tvr"
    assert main([*args, str(root)]) == EXIT_BAD_INPUT
    assert _error(capsys) == f"split 'val' not found: the data root {root} does not exist (a data root holds TextData/ and FeatureData/)"
    root.mkdir(parents=True)
    assert main([*args, str(root)]) == EXIT_BAD_INPUT
    assert _error(capsys) == f"split 'val' not found: {root} has no TextData folder (a data root holds TextData/ and FeatureData/)"
    (root / "TextData").mkdir()
    (root / "TextData" / "synthval.caption.txt").write_text("")
    assert main([*args, str(root)]) == EXIT_BAD_INPUT
    assert _error(capsys) == (f"split 'val' not found: no caption file of collection 'tvr' in {root / 'TextData'} "
                              "(looked for tvrval.caption.txt); caption files there: synthval.caption.txt")
