"""The command line: happy paths on tiny data and one clear error per bad input."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from prvrlab.platform.cli import EXIT_BAD_INPUT, main
from prvrlab.platform.tracking.store import Tracker

from train_helpers import small_raw


def write_config(path: Path, raw: dict) -> Path:
    path.write_text(yaml.safe_dump(raw))
    return path


def run_count(raw: dict) -> int:
    db = Path(raw["tracking"]["uri"][len("sqlite:///") :])
    if not db.exists():
        return 0
    tracker = Tracker(raw["tracking"]["uri"], raw["tracking"]["experiment"])
    return len(tracker.client.search_runs([tracker.experiment_id]))


def test_missing_config_file(tmp_path, capsys):
    assert main(["train", str(tmp_path / "nope.yaml")]) == EXIT_BAD_INPUT
    assert "config file not found" in capsys.readouterr().err


def test_unknown_key_names_key_and_suggestion(tiny_root, tmp_path, capsys):
    cfg = write_config(tmp_path / "c.yaml", small_raw(tiny_root, tmp_path))
    assert main(["train", str(cfg), "--set", "train.epoch=3"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.startswith("prvrlab: error: --set train.epoch: unknown key") and "did you mean 'train.epochs'?" in err
    assert "c.yaml" not in err


def test_unknown_split_lists_the_splits_with_captions(tiny_root):
    from prvrlab.data.collection import open_collection
    from prvrlab.data.config import DataConfig
    from prvrlab.data.errors import DataError

    collection = open_collection(DataConfig(root=str(tiny_root)), validate_splits=False)
    with pytest.raises(DataError) as exc:
        collection.split("tst")
    assert str(exc.value) == f"split 'tst' not found in {tiny_root / 'TextData'}; splits with captions: train, val, test (did you mean 'test'?)"


def test_help_has_description_examples_and_help_for_every_argument(capsys):
    import argparse

    from prvrlab.platform.cli import build_parser

    parser = build_parser()
    text = parser.format_help()
    assert "command line." not in text and "Partially Relevant Video Retrieval" in text
    assert 4 <= text.count("\n  prvrlab ") <= 6
    stack = [("prvrlab", parser)]
    while stack:
        name, p = stack.pop()
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                stack += [(f"{name} {n}", sub) for n, sub in action.choices.items()]
            elif not isinstance(action, argparse._HelpAction):
                assert action.help, f"{name} {action.option_strings or action.dest}: no help text"


def test_missing_data_is_named_and_nothing_is_recorded(tmp_path, capsys):
    raw = small_raw(tmp_path / "no_such_collection", tmp_path)
    cfg = write_config(tmp_path / "c.yaml", raw)
    assert main(["train", str(cfg), "--no-ray"]) == EXIT_BAD_INPUT
    assert "no_such_collection" in capsys.readouterr().err
    assert run_count(raw) == 0


def test_corrupt_feature_bin_is_named(tiny_root, tmp_path, capsys):
    root = tmp_path / "copy"
    shutil.copytree(tiny_root, root)
    feature_bin = next(root.glob("FeatureData/*/feature.bin"))
    feature_bin.write_bytes(feature_bin.read_bytes()[:-8])
    assert main(["data", "inspect", "--root", str(root)]) == EXIT_BAD_INPUT
    assert "feature.bin" in capsys.readouterr().err


def test_synth_and_inspect(tmp_path, capsys):
    assert main(["data", "synth", "--preset", "tiny", "--out", str(tmp_path / "s"), "--quiet"]) == 0
    assert main(["data", "inspect", "--root", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    assert "train" in out and "val" in out


def test_check_prints_resolved_config(tiny_root, tmp_path, capsys):
    cfg = write_config(tmp_path / "c.yaml", small_raw(tiny_root, tmp_path))
    assert main(["train", str(cfg), "--check", "--set", "train.lr=0.01"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["train"]["lr"] == 0.01



def test_preset_applies_before_set_and_bad_names_exit_2(tiny_root, tmp_path, capsys):
    cfg = write_config(tmp_path / "c.yaml", small_raw(tiny_root, tmp_path))
    assert main(["train", str(cfg), "--check"]) == 0
    official = yaml.safe_load(capsys.readouterr().out)
    assert (official["model"]["window"], official["train"]["warmup"]) == ("official", "official")
    assert main(["train", str(cfg), "--check", "--preset", "corrected", "--set", "train.warmup=official"]) == 0
    corrected = yaml.safe_load(capsys.readouterr().out)
    assert (corrected["model"]["window"], corrected["data"]["last_bin"]) == ("centred", "inclusive")
    assert corrected["train"]["warmup"] == "official"  # --set comes after the preset
    assert main(["train", str(cfg), "--check", "--preset", "correctd"]) == EXIT_BAD_INPUT
    assert "did you mean 'corrected'" in capsys.readouterr().err


def test_train_then_eval_checkpoint(tiny_root, tmp_path, capsys):
    raw = small_raw(tiny_root, tmp_path, epochs=2)
    cfg = write_config(tmp_path / "c.yaml", raw)
    assert main(["train", str(cfg), "--no-ray"]) == 0
    out = capsys.readouterr().out
    assert "epoch   2/2" in out and "best val SumR" in out
    (best,) = (tmp_path / "results").glob("*/files/best_model.pt")
    ranks = tmp_path / "ranks.parquet"
    assert main(["eval", str(best), "--split", "test", "--ranks", str(ranks)]) == 0
    assert "SumR" in capsys.readouterr().out
    assert pq.read_table(ranks).num_rows > 0


def test_eval_rejects_a_file_that_is_not_a_checkpoint(tmp_path, capsys):
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")
    assert main(["eval", str(junk)]) == EXIT_BAD_INPUT
    assert "junk.pt" in capsys.readouterr().err


def test_sigterm_closes_the_run_as_killed(tiny_root, tmp_path):
    import signal
    import subprocess
    import sys

    raw = small_raw(tiny_root, tmp_path, epochs=500, early_stop_patience=500)
    cfg = write_config(tmp_path / "c.yaml", raw)
    proc = subprocess.Popen(
        [sys.executable, "-m", "prvrlab.platform.cli", "train", str(cfg), "--no-ray"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        for line in proc.stdout:
            if line.startswith("epoch"):
                break
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 130
    finally:
        proc.kill()
    tracker = Tracker(raw["tracking"]["uri"], raw["tracking"]["experiment"])
    (run,) = tracker.client.search_runs([tracker.experiment_id])
    assert run.info.status == "KILLED"


def test_nan_features_refuse_training_before_a_run_is_recorded(tiny_root, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PRVRLAB_CACHE_DIR", str(tmp_path / "cache"))
    root = tmp_path / "copy"
    shutil.copytree(tiny_root, root)
    feature_bin = next(root.glob("FeatureData/*/feature.bin"))
    data = bytearray(feature_bin.read_bytes())
    data[8:12] = b"\x00\x00\xc0\x7f"  # NaN in row 0
    feature_bin.write_bytes(bytes(data))
    raw = small_raw(root, tmp_path)
    cfg = write_config(tmp_path / "c.yaml", raw)
    assert main(["train", str(cfg), "--no-ray"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "feature.bin: non-finite value" in err and "row 0" in err and len(err.strip().splitlines()) == 1
    assert run_count(raw) == 0


def test_inspect_accepts_the_parent_of_a_released_collection(tmp_path, capsys):
    assert main(["data", "synth", "--preset", "tiny", "--out", str(tmp_path / "synth"), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["data", "inspect", "--root", str(tmp_path), "--collection", "synth"]) == 0
    out = capsys.readouterr().out
    assert f"at {tmp_path / 'synth'}" in out and "note: data.visual_feature not given: using the only feature store" in out


def test_help_loads_neither_torch_nor_ray_nor_mlflow():
    """``prvrlab --help`` (and main's error handling) stays quick: the errors it catches are defined in light modules."""
    import subprocess
    import sys

    script = (
        "import sys\nfrom prvrlab.platform.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('torch', 'ray', 'mlflow') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage: prvrlab" in out.stdout and out.stdout.strip().splitlines()[-1] == "[]"


def test_the_console_script_exits_with_mains_code_after_freezing_the_collector(monkeypatch):
    """``run`` (the ``prvrlab`` script) returns main's exit code and freezes the garbage collector only
    after main is done: the interpreter's last collections at exit skip the frozen objects."""
    import gc

    from prvrlab.platform import cli

    order = []
    monkeypatch.setattr(cli, "main", lambda: order.append("main") or 3)
    monkeypatch.setattr(gc, "freeze", lambda: order.append("freeze"))
    with pytest.raises(SystemExit) as stop:
        cli.run()
    assert stop.value.code == 3
    assert order == ["main", "freeze"]
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+; on 3.10 the checks above still ran
    scripts = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["prvrlab"] == "prvrlab.platform.cli:run"


@pytest.mark.parametrize("command", ["search", "ablate"])
def test_a_bad_spec_is_refused_before_ray_tune_is_imported(tmp_path, command):
    """The spec is checked first: a typo costs the check, not Ray Tune's import (about 2 s) as well."""
    import subprocess
    import sys

    spec = {"name": "typo", "base_config": str(Path(__file__).resolve().parents[2] / "configs" / "gmmformer_synth.yaml")}
    if command == "search":
        spec |= {"space": {"train.lrr": {"loguniform": [1e-4, 1e-3]}}, "budget": {"trials": 2}}
    else:
        spec |= {"variants": {"full": {}, "off": {"losses.query_diverze.weight": 0}}, "seeds": [0]}
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(spec))
    script = (
        "import sys\nfrom prvrlab.platform.cli import main\n"
        f"code = main([{command!r}, {str(path)!r}])\n"
        "print(code, 'ray.tune' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "2 False", out.stdout + out.stderr[-2000:]
    assert ("train.lrr" if command == "search" else "query_diverze") in out.stderr


def test_the_console_script_shuts_ray_down_itself_only_where_the_command_connected(monkeypatch, capsys):
    """run() ends a connected Ray (before its exit handler's 0.5 s log wait); no Ray, nothing to do; a failing
    shutdown only warns."""
    import sys
    from types import SimpleNamespace

    from prvrlab.platform import cli

    calls = []

    def fake_ray(connected: bool, fails: bool = False):
        def shutdown():
            calls.append("shutdown")
            if fails:
                raise RuntimeError("raylet gone")

        return SimpleNamespace(is_initialized=lambda: connected, shutdown=shutdown)

    for connected, fails, expected in ((False, False, []), (True, False, ["shutdown"]), (True, True, ["shutdown"])):
        calls.clear()
        monkeypatch.setitem(sys.modules, "ray", fake_ray(connected, fails))
        cli._shutdown_ray()
        assert calls == expected
    assert "shutting Ray down failed: raylet gone" in capsys.readouterr().err
    monkeypatch.delitem(sys.modules, "ray")
    cli._shutdown_ray()  # Ray never imported: nothing to do


def test_the_resume_hint_after_an_interrupt_keeps_the_spec_and_its_set_overrides():
    """It had dropped --set, and the hint then failed: a resume without them is another spec, refused."""
    import argparse
    import shlex

    from prvrlab.platform.cli import _resume_command

    args = argparse.Namespace(spec="search_spaces/a b.yaml", set=["train.lr=5e-4", "eval.final_splits=[val, test]"])
    hint = _resume_command("ablate", args)
    assert hint == "prvrlab ablate 'search_spaces/a b.yaml' --set train.lr=5e-4 --set 'eval.final_splits=[val, test]' --resume"
    assert shlex.split(hint)[2:] == [args.spec, "--set", args.set[0], "--set", args.set[1], "--resume"]
    assert _resume_command("search", argparse.Namespace(spec="s.yaml", set=[])) == "prvrlab search s.yaml --resume"
