"""Bad options and arguments of the commands: one line naming the option, exit 2, nothing recorded."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from prvrlab.platform.cli import EXIT_BAD_INPUT, main

from train_helpers import small_raw


def one_error_line(capsys) -> str:
    """The only line on stderr, an error of prvrlab (no traceback, no usage)."""
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("prvrlab"), err
    return lines[0]


def path_message(key: str, path: Path) -> str:
    return (f"{key}: '{path}' is a file path; use sqlite:///<absolute path> for a SQLite file "
            "(or http(s)://host:port for a server)")


@pytest.mark.parametrize("command", [["report", "--experiment", "X"], ["compare", "run1", "run2"]])
def test_tracking_uri_option_that_is_a_path(tmp_path, capsys, command):
    db = tmp_path / "x" / "mlflow.db"
    assert main([*command, "--tracking-uri", str(db)]) == EXIT_BAD_INPUT
    assert one_error_line(capsys) == f"prvrlab: error: {path_message('--tracking-uri', db)}"
    assert not db.parent.exists()


def test_tracking_uri_key_that_is_a_path(tiny_root, tmp_path, capsys):
    raw = small_raw(tiny_root, tmp_path, epochs=1)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    db = tmp_path / "x.db"
    assert main(["train", str(cfg), "--no-ray", "--set", f"tracking.uri={db}"]) == EXIT_BAD_INPUT
    assert one_error_line(capsys).endswith(path_message("tracking.uri", db))
    assert not db.exists() and not (tmp_path / "mlflow.db").exists() and not (tmp_path / "results").exists()


def test_tracking_uri_environment_variable_that_is_a_path(tmp_path, capsys, monkeypatch):
    db = tmp_path / "env.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", str(db))
    assert main(["compare", "run1", "run2"]) == EXIT_BAD_INPUT
    assert one_error_line(capsys) == f"prvrlab: error: {path_message('$MLFLOW_TRACKING_URI', db)}"


def ablation_store(tmp: Path) -> tuple[str, str]:
    """(tracking URI, parent id) of a finished two-variant ablation whose runs logged final val and test metrics."""
    from prvrlab.platform.tracking.store import Tracker

    uri = f"sqlite:///{tmp / 'study.db'}"
    tracker = Tracker(uri, "tests")
    parent = tracker.start_run("abl", tags={"prvrlab.kind": "ablation", "prvrlab.study": "abl"})
    tracker.log_params(parent, {"spec.baseline": "base", "spec.seeds": "[0]", "variant.base": "{}", "variant.other": "{}"})
    for variant in ("base", "other"):
        tags = {"prvrlab.kind": "trial", "prvrlab.status": "finished", "prvrlab.variant": variant, "prvrlab.seed": "0"}
        run = tracker.start_run(f"abl/{variant}/seed0", tags=tags, parent_run_id=parent)
        tracker.log_metrics(run, {f"final/{s}/{m}": 10.0 for s in ("val", "test") for m in ("r1", "r5", "r10", "r100", "sumr")})
        tracker.end_run(run, "FINISHED")
    tracker.end_run(parent, "FINISHED")
    return uri, parent


@pytest.mark.parametrize("command", ["report", "compare"])
def test_split_that_no_run_logged(tmp_path, capsys, command):
    from prvrlab.platform.tracking.store import Tracker

    uri, parent = ablation_store(tmp_path)
    capsys.readouterr()  # MLflow's note that it created the store
    client = Tracker(uri, "tests").client
    children = [r.info.run_id for r in client.search_runs([client.get_run(parent).info.experiment_id])
                if r.info.run_id != parent]
    out = tmp_path / "out"
    who = ["--run-id", parent] if command == "report" else children
    assert main([command, *who, "--tracking-uri", uri, "--split", "tset", "--out", str(out)]) == EXIT_BAD_INPUT
    assert one_error_line(capsys) == (
        "prvrlab: error: split 'tset': the runs logged no final tset metrics (final/tset/sumr); "
        "splits they logged: test, val (did you mean 'test'?)"
    )
    assert not out.exists() and client.list_artifacts(parent) == []


@pytest.fixture(scope="module")
def synthetic_model(tiny_root, tmp_path_factory) -> Path:
    """best_model.pt of a 1-epoch run whose config generates its data (data.synthesize: tiny)."""
    tmp = tmp_path_factory.mktemp("eval")
    raw = small_raw(tiny_root, tmp, epochs=1)
    raw["data"]["synthesize"] = "tiny"
    cfg = tmp / "c.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    assert main(["train", str(cfg), "--no-ray"]) == 0
    (best,) = (tmp / "results").glob("*/files/best_model.pt")
    return best


@pytest.fixture
def no_evaluation(monkeypatch):
    """Fail a test whose command starts evaluating: its bad input must be refused before."""
    from prvrlab.platform.train import checkpoint_eval

    def refuse(*args, **kwargs):
        raise AssertionError("evaluated before the input was checked")

    monkeypatch.setattr(checkpoint_eval, "evaluate_checkpoint", refuse)


def test_eval_ranks_destination_is_checked_before_evaluating(synthetic_model, tmp_path, capsys, no_evaluation):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, not a folder")
    cases = {
        str(tmp_path): f"--ranks {tmp_path}: is a folder; give a file name in it",
        str(blocker / "r.parquet"): f"--ranks {blocker}: not a writable folder ({blocker} is a file)",
        "s3:/bad": "--ranks: 's3:/bad' is not a URI; write s3://bucket/path",
        "s3://bucket": "--ranks: 's3://bucket' names a bucket, not a file",
    }
    for ranks, message in cases.items():
        assert main(["eval", str(synthetic_model), "--ranks", ranks]) == EXIT_BAD_INPUT
        assert one_error_line(capsys) == f"prvrlab: error: {message}"


class NotAllowed:
    """An object torch.load(weights_only=True) refuses to unpickle."""


@pytest.mark.parametrize("kind", ["yaml", "pickled object"])
def test_eval_of_a_file_that_is_not_a_checkpoint_says_what_was_expected(tmp_path, capsys, kind):
    import torch

    path = tmp_path / ("config.yaml" if kind == "yaml" else "other.pt")
    if kind == "yaml":
        path.write_text(yaml.safe_dump(small_raw(tmp_path, tmp_path)))
    else:
        torch.save({"model": NotAllowed()}, path)
    assert main(["eval", str(path)]) == EXIT_BAD_INPUT
    line = one_error_line(capsys)
    assert line.startswith(f"prvrlab: error: {path}: not a") and "expected a best_model.pt written by prvrlab" in line
    assert "weights_only" not in line


def test_eval_data_root_that_does_not_exist_is_not_generated(synthetic_model, tmp_path, capsys, no_evaluation):
    typo = tmp_path / "typo"
    assert main(["eval", str(synthetic_model), "--data-root", str(typo)]) == EXIT_BAD_INPUT
    assert one_error_line(capsys) == (
        f"prvrlab: error: --data-root {typo}: folder not found; write the model's synthetic collection there with  "
        f"prvrlab data synth --preset tiny --seed 0 --out {typo}"
    )
    assert not typo.exists()


@pytest.mark.parametrize(
    ("argv", "option", "problem"),
    [
        (["profile", "c.yaml", "--device", "cuda"], "--device", "'cuda': torch sees no CUDA device here; use cpu"),
        (["profile", "c.yaml", "--device", "gpu"], "--device", "unknown device 'gpu'; use cpu or cuda"),
        (["profile", "c.yaml", "--gallery", "500", "0"], "--gallery", "expected a positive integer, got '0'"),
        (["profile", "c.yaml", "--queries", "-3"], "--queries", "expected a positive integer, got '-3'"),
        (["report", "--experiment", "X", "--bootstrap", "0"], "--bootstrap", "expected a positive integer, got '0'"),
        (["compare", "run1", "run2", "--bootstrap", "0"], "--bootstrap", "expected a positive integer, got '0'"),
    ],
)
def test_bad_option_values_are_one_line_naming_the_option(capsys, monkeypatch, argv, option, problem):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU-only torch, on any machine
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == EXIT_BAD_INPUT
    prog = f"prvrlab {argv[0]}"
    assert one_error_line(capsys) == f"{prog}: error: argument {option}: {problem} (see {prog} --help)"


def test_outputs_under_a_regular_file(tiny_root, tmp_path, capsys):
    from prvrlab.platform.tracking.store import Tracker

    uri, parent = ablation_store(tmp_path)
    capsys.readouterr()  # MLflow's note that it created the store
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, not a folder")
    feature = next((tiny_root / "FeatureData").iterdir())
    cases = [
        (["report", "--run-id", parent, "--tracking-uri", uri, "--out", str(blocker / "r")], "--out", blocker / "r"),
        (["compare", "run1", "run2", "--out", str(blocker / "c.md")], "--out", blocker),
        (["data", "synth", "--preset", "tiny", "--out", str(blocker)], "--out", blocker),
        (["data", "convert", str(feature), str(blocker / "x.hdf5")], "dst", blocker),
    ]
    for argv, option, folder in cases:
        assert main(argv) == EXIT_BAD_INPUT
        assert one_error_line(capsys) == f"prvrlab: error: {option} {folder}: not a writable folder ({blocker} is a file)"
    assert blocker.read_text() == "a file, not a folder"
    assert Tracker(uri, "tests").client.list_artifacts(parent) == []


@pytest.mark.parametrize("command", [["search"], ["ablate"], ["report", "--spec"]])
def test_experiment_config_given_as_a_spec_says_to_train_it(tiny_root, tmp_path, capsys, command):
    parent = tmp_path / "parent.yaml"
    parent.write_text(yaml.safe_dump(small_raw(tiny_root, tmp_path)))
    cfg = tmp_path / "child.yaml"
    cfg.write_text(yaml.safe_dump({"extends": "parent.yaml", "train": {"lr": 0.01}}))
    assert main([*command, str(cfg)]) == EXIT_BAD_INPUT
    line = one_error_line(capsys)
    assert "this looks like an experiment config (extends, train), not a spec" in line
    assert f"'prvrlab train {cfg}'" in line and line.count("looks like") == 1


def test_train_on_a_root_holding_another_synthetic_collection_is_refused(tiny_root, tmp_path, capsys):
    """data.synthesize / data.synth_seed name another collection than the one synth.json records in data.root:
    training would run on the root's data while recording the config's settings."""
    import json

    recorded = json.loads((tiny_root / "synth.json").read_text())
    root = tiny_root.resolve()
    repo = Path(__file__).resolve().parents[2]
    argv = ["train", str(repo / "configs" / "gmmformer_synth.yaml"), "--no-ray",
            "--set", f"data.root={tiny_root}", "--set", "data.synthesize=small", "--set", "data.synth_seed=3",
            "--set", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}",
            "--set", f"tracking.storage_path={tmp_path / 'results'}"]
    assert main(argv) == EXIT_BAD_INPUT
    assert one_error_line(capsys) == (
        f"prvrlab: error: data.root {root}: holds another synthetic collection than the config asks for: "
        f"data.synthesize=small (its synth.json: {recorded['name']}), data.synth_seed=3 (its synth.json: {recorded['seed']}); "
        f"give data.root another folder for this collection, or set data.synthesize={recorded['name']} "
        f"data.synth_seed={recorded['seed']} to use the one there"
    )
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "results").exists()
    assert json.loads((tiny_root / "synth.json").read_text()) == recorded


def test_data_convert_into_its_own_source_folder_is_refused(tiny_root, tmp_path, capsys):
    """The destination is the BigFile folder or lies inside it (also through a symlink): the source is kept."""
    import shutil

    src = tmp_path / "FeatureData" / "synth_feat"
    shutil.copytree(tiny_root / "FeatureData" / "synth_feat", src)
    (tmp_path / "link").symlink_to(src, target_is_directory=True)
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    inside = ("lies inside the source folder {src} (it would overwrite or add to the source's files); "
              "give an HDF5 file name outside it")
    cases = [
        (src, src / "feature.bin", inside),
        (src, src / "features.hdf5", inside),
        (src, tmp_path / "link" / "feature.bin", inside),
        (tmp_path / "link", src / "id.txt", inside),
        (src, src, "is the source folder {src}; give an HDF5 file name outside it"),
        (src, tmp_path / "link", "is the source folder {src}; give an HDF5 file name outside it"),
    ]
    for source, dst, problem in cases:
        assert main(["data", "convert", str(source), str(dst), "--quiet"]) == EXIT_BAD_INPUT
        assert one_error_line(capsys) == f"prvrlab: error: dst {dst}: {problem.format(src=source)}"
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before
    out = tmp_path / "FeatureData" / "synth_feat.hdf5"  # next to the folder: fine
    assert main(["data", "convert", str(src), str(out), "--quiet"]) == 0 and out.is_file()
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before


def test_data_inspect_without_a_single_feature_store_names_its_option(tiny_root, tmp_path, capsys):
    """data inspect --root takes the store as --visual-feature (data.visual_feature is for --config)."""
    import shutil

    root = tmp_path / "data"
    shutil.copytree(tiny_root, root)
    feature_dir = root / "FeatureData"
    shutil.copytree(feature_dir / "synth_feat", feature_dir / "other_feat")
    assert main(["data", "inspect", "--root", str(root)]) == EXIT_BAD_INPUT
    assert one_error_line(capsys) == (
        f"prvrlab: error: several visual feature stores in {feature_dir}: other_feat, synth_feat; "
        "set --visual-feature to one"
    )
    assert main(["data", "inspect", "--root", str(root), "--visual-feature", "synth_feat"]) == 0
    capsys.readouterr()
    for store in ("other_feat", "synth_feat"):
        shutil.rmtree(feature_dir / store)
    assert main(["data", "inspect", "--root", str(root)]) == EXIT_BAD_INPUT
    assert one_error_line(capsys) == (
        f"prvrlab: error: no visual feature store (BigFile folder or .hdf5 file) in {feature_dir}; set --visual-feature"
    )
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(small_raw(root, tmp_path) | {"data": {"root": str(root), "collection": "synth"}}))
    assert main(["data", "inspect", "--config", str(cfg)]) == EXIT_BAD_INPUT  # the config's key there
    assert one_error_line(capsys).endswith(f"in {feature_dir}; set data.visual_feature")


def test_eval_of_a_checkpoint_with_entries_training_never_writes_is_one_line(synthetic_model, tmp_path, capsys):
    """A format newer than this prvrlab's, or entries of other types (a hand-made or damaged file), are refused
    by name before a model is built; weights of another model's shapes name the first key of each kind."""
    import torch

    from prvrlab.platform.train.loop import CHECKPOINT_FORMAT

    blob = torch.load(synthetic_model, map_location="cpu", weights_only=True)
    weights = blob["model"]
    first = next(iter(weights))
    renamed = {("renamed." + k if k == first else k): v for k, v in weights.items()}
    resized = {**weights, first: torch.zeros(3, 3)}
    legacy_key = next(k for k in weights if k.startswith("query.proj."))  # an earlier layout: query_proj.*
    legacy = {("query_proj." + k[len("query.proj."):] if k.startswith("query.proj.") else k): v for k, v in weights.items()}
    legacy["query_proj." + legacy_key[len("query.proj."):]] = torch.zeros(3, 3)
    cases = {
        "newer": ({**blob, "format": CHECKPOINT_FORMAT + 1}, f"checkpoint format {CHECKPOINT_FORMAT + 1} was written by "
                  f"a newer prvrlab; this one reads formats 1 to {CHECKPOINT_FORMAT} (upgrade prvrlab to evaluate it)"),
        "format": ({**blob, "format": "8"}, "not a prvrlab checkpoint: its 'format' is '8', not a whole number >= 1"),
        "config": ({**blob, "config": ["a", "list"]}, "not a prvrlab checkpoint: its 'config' is a list, not a mapping"),
        "model": ({**blob, "model": {"w": [1.0]}},
                  "not a prvrlab checkpoint: its 'model' is not a state dict (parameter names to tensors)"),
        "epoch": ({**blob, "epoch": -1}, "not a prvrlab checkpoint: its 'epoch' is -1, not a whole number >= 0"),
        "renamed": ({**blob, "model": renamed}, f"weights do not fit the configured model: 1 missing (first: {first}); "
                    f"1 unexpected (first: renamed.{first})"),
        "resized": ({**blob, "model": resized}, "weights do not fit the configured model: 1 of another shape "
                    f"(first: {first} (3, 3) vs {tuple(weights[first].shape)})"),
        "legacy": ({**blob, "model": legacy}, "weights do not fit the configured model: 1 of another shape "
                   f"(first: {legacy_key} (3, 3) vs {tuple(weights[legacy_key].shape)})"),  # counted after the renames
    }
    for name, (edited, message) in cases.items():
        path = tmp_path / f"{name}.pt"
        torch.save(edited, path)
        assert main(["eval", str(path)]) == EXIT_BAD_INPUT, name
        assert one_error_line(capsys) == f"prvrlab: error: {path}: {message}", name


def test_eval_data_root_that_is_a_file_or_another_synthetic_collection_is_refused(synthetic_model, tmp_path, capsys, no_evaluation):
    """The model was trained on the tiny preset with seed 0: a --data-root holding the tiny preset of seed 3 is
    other data (its synth.json says so), refused naming the option; a file is not a folder."""
    from prvrlab.data.synth import synthesize

    afile = tmp_path / "afile"
    afile.write_text("x")
    assert main(["eval", str(synthetic_model), "--data-root", str(afile)]) == EXIT_BAD_INPUT
    assert one_error_line(capsys) == f"prvrlab: error: --data-root {afile}: not a folder; give the folder that holds the collection"
    other = tmp_path / "other"
    synthesize(other, preset="tiny", seed=3, progress=False)
    assert main(["eval", str(synthetic_model), "--data-root", str(other)]) == EXIT_BAD_INPUT
    assert one_error_line(capsys) == (
        f"prvrlab: error: --data-root {other}: holds another synthetic collection than the model was trained on: "
        "data.synth_seed=0 (its synth.json: 3); give --data-root a folder of that collection, or write one with  "
        "prvrlab data synth --preset tiny --seed 0 --out <new folder>"
    )


def test_a_loss_term_name_mlflow_cannot_store_fails_train_check_naming_it(tiny_root, tmp_path, capsys):
    """``clip+nce`` cannot be part of an MLflow param key (losses.clip+nce.weight): --check refuses it, and a
    real run is refused before it exists."""
    raw = small_raw(tiny_root, tmp_path)
    raw["losses"]["clip+nce"] = raw["losses"].pop("clip_nce")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    for command in (["train", str(cfg), "--check"], ["train", str(cfg), "--no-ray"]):
        assert main(command) == EXIT_BAD_INPUT
        assert one_error_line(capsys).startswith(f"prvrlab: error: {cfg}: losses.clip+nce: ")
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "results").exists()


def test_a_checkpoint_naming_a_missing_synthetic_root_elsewhere_creates_nothing(synthetic_model, tmp_path, capsys, no_evaluation):
    """The data root in a checkpoint's config is the checkpoint's word: eval reads it, never writes it."""
    import torch

    blob = torch.load(synthetic_model, map_location="cpu", weights_only=True)
    elsewhere = tmp_path / "anywhere" / "planted"
    blob["config"]["data"]["root"] = str(elsewhere)
    moved = tmp_path / "moved" / "best_model.pt"
    moved.parent.mkdir()
    torch.save(blob, moved)
    assert main(["eval", str(moved)]) == EXIT_BAD_INPUT
    assert one_error_line(capsys) == (
        f"prvrlab: error: {moved}: its data root {elsewhere} does not exist; write the model's synthetic collection "
        f"there with  prvrlab data synth --preset tiny --seed 0 --out {elsewhere}  (or give --data-root)"
    )
    assert not (tmp_path / "anywhere").exists()


def test_data_inspect_refuses_options_its_config_would_override(tmp_path, capsys):
    """--root, --collection, ... with --config, and --set without it, had been ignored silently."""
    config = tmp_path / "c.yaml"
    config.write_text("name: c\n")
    assert main(["data", "inspect", "--config", str(config), "--root", str(tmp_path / "nope")]) == EXIT_BAD_INPUT
    assert "--root: not used with --config" in capsys.readouterr().err
    assert main(["data", "inspect", "--root", str(tmp_path), "--set", "data.root=/nope"]) == EXIT_BAD_INPUT
    assert "--set: overrides the config --config names" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["train", "configs/gmmformer_synth.yaml", "--check"],
                                     ["search", "search_spaces/gmmformer_synth_tiny.yaml", "--check"]])
def test_a_set_key_given_twice_is_refused_naming_both_values(capsys, command):
    """The last value had won silently; a typo'd sweep script could train the wrong setting."""
    repo = Path(__file__).resolve().parents[2]
    argv = [command[0], str(repo / command[1]), *command[2:], "--set", "train.early_stop_patience=5", "--set", " train.early_stop_patience=7"]
    assert main(argv) == EXIT_BAD_INPUT
    assert "--set train.early_stop_patience: given twice (5, then 7); give each key once" in one_error_line(capsys)
    assert main(argv[:-2]) == 0  # once is fine


def test_file_uri_outputs_are_written_at_their_path_and_object_store_folders_refused(tiny_root, tmp_path, capsys, monkeypatch):
    """``file:///abs`` had been written to a folder named ``file:`` under the current directory (and ``s3://`` to
    ``s3:``), while the command said it wrote the URI."""
    import shutil

    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    synth = tmp_path / "synth"
    assert main(["data", "synth", "--preset", "tiny", "--out", synth.as_uri(), "--quiet"]) == 0
    assert (synth / "FeatureData").is_dir() and f"to {synth}" in capsys.readouterr().out
    assert main(["data", "synth", "--preset", "tiny", "--out", "s3://bucket/synth", "--quiet"]) == EXIT_BAD_INPUT
    assert one_error_line(capsys) == ("prvrlab: error: --out s3://bucket/synth: an object-store folder; this command "
                                      "writes a local folder (give a local path, then copy the folder up)")
    src = tmp_path / "feat"
    shutil.copytree(tiny_root / "FeatureData" / "synth_feat", src)
    out = tmp_path / "feat.h5"
    assert main(["data", "convert", str(src), out.as_uri(), "--quiet"]) == 0 and out.is_file()
    assert main(["data", "convert", str(src), (src / "x.h5").as_uri(), "--quiet"]) == EXIT_BAD_INPUT  # inside: refused
    assert "lies inside the source folder" in one_error_line(capsys)
    assert list(work.iterdir()) == []  # no 'file:' or 's3:' folder here


def test_data_inspect_root_without_collection_reads_the_splits_present(tiny_root, tmp_path, capsys):
    """Without --collection it had looked for 'None*.caption.txt' and fallen back to train/val/test."""
    import shutil

    root = tmp_path / "notest"
    shutil.copytree(tiny_root, root)
    for f in (root / "TextData").glob("synthtest*"):
        f.unlink()
    assert main(["data", "inspect", "--root", str(root)]) == 0
    out = capsys.readouterr().out
    splits = [line.split()[0] for line in out.splitlines() if line.strip().startswith(("train ", "val ", "test "))]
    assert splits == ["train", "val"]


def test_data_inspect_of_a_collection_the_root_does_not_hold_names_both_places(tmp_path, capsys):
    """`data inspect --root data --collection tvr` without data/tvr had said "no visual feature store in data/FeatureData"."""
    (tmp_path / "data" / "synth").mkdir(parents=True)
    root = tmp_path / "data"
    assert main(["data", "inspect", "--root", str(root), "--collection", "tvr"]) == EXIT_BAD_INPUT
    assert one_error_line(capsys) == (f"prvrlab: error: --root {root}: holds no collection 'tvr' (neither "
                                      f"{root / 'TextData'} nor {root / 'tvr'}/ exists)")
