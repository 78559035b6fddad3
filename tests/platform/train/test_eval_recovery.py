"""``prvrlab eval`` of a recovery checkpoint (state.pt: the last reported epoch's weights, no config)
and the device an evaluation runs on."""

from __future__ import annotations

import shutil

import pytest
import torch
import yaml

from prvrlab.platform.cli import EXIT_BAD_INPUT, main
from prvrlab.platform.config import validate
from prvrlab.platform.train import checkpoint_eval
from prvrlab.platform.train.checkpoint_eval import eval_device, evaluate_checkpoint, load_checkpoint, recovery_config

from train_helpers import small_raw


@pytest.fixture(scope="module")
def trained(tiny_root, tmp_path_factory):
    """A 2-epoch ``train --no-ray`` run: (its files folder, its recovery checkpoint folder)."""
    tmp = tmp_path_factory.mktemp("recovery")
    cfg = tmp / "c.yaml"
    cfg.write_text(yaml.safe_dump(small_raw(tiny_root, tmp, epochs=2)))
    assert main(["train", str(cfg), "--no-ray"]) == 0
    (files,) = (tmp / "results").glob("*/files")
    return files, files / "local_session" / "checkpoint_latest"


def _perturbed(state: dict) -> dict:
    """``state`` with every floating weight moved (so its ranks cannot be the best model's by chance)."""
    gen = torch.Generator().manual_seed(1)
    model = {k: v + 0.05 * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v for k, v in state["model"].items()}
    return {**state, "model": model}


def test_a_recovery_checkpoint_is_evaluated_with_its_weights_and_its_run_config(trained, tmp_path, capsys):
    files, latest = trained
    state = torch.load(latest / "state.pt", weights_only=True)
    assert state["progress"]["epoch"] == 1  # the last finished epoch, counted from 0
    # the same layout as training writes, with weights no epoch had
    run = tmp_path / "run"
    (run / "local_session" / "checkpoint_latest").mkdir(parents=True)
    shutil.copy(files / "config.yaml", run / "config.yaml")
    moved = _perturbed(state)
    torch.save(moved, run / "local_session" / "checkpoint_latest" / "state.pt")
    # expected: a best_model.pt made by hand from those weights and the run's config
    best = torch.load(files / "best_model.pt", weights_only=True)
    by_hand = tmp_path / "by_hand.pt"
    torch.save({"model": moved["model"], "config": best["config"], "format": best["format"], "epoch": 2}, by_hand)
    expected = evaluate_checkpoint(by_hand, split="val")
    for given in (run / "local_session" / "checkpoint_latest", run / "local_session" / "checkpoint_latest" / "state.pt"):
        got = evaluate_checkpoint(given, split="val")
        assert (got.ranks == expected.ranks).all() and got.metrics == expected.metrics
    assert not (evaluate_checkpoint(files / "best_model.pt", split="val").ranks == expected.ranks).all()
    assert main(["eval", str(run / "local_session" / "checkpoint_latest"), "--split", "val"]) == 0
    out = capsys.readouterr().out
    assert f"config {(run / 'config.yaml').resolve()}" in out
    assert f"model of epoch {state['progress']['epoch'] + 1}  val:" in out
    assert f"SumR {expected.metrics['sumr']:.1f}" in out


def test_the_config_of_a_recovery_checkpoint_is_found_where_training_writes_it(tmp_path):
    local = tmp_path / "a" / "files" / "local_session" / "checkpoint_latest" / "state.pt"
    ray_train = tmp_path / "b" / "run" / "checkpoint_000003" / "state.pt"
    for state in (local, ray_train):
        state.parent.mkdir(parents=True)
        state.write_bytes(b"")
    assert recovery_config(local) is None and recovery_config(ray_train) is None
    (tmp_path / "a" / "files" / "config.yaml").write_text("name: a\n")
    (tmp_path / "b" / "run" / "files").mkdir()
    (tmp_path / "b" / "run" / "files" / "config.yaml").write_text("name: b\n")
    assert recovery_config(local) == (tmp_path / "a" / "files" / "config.yaml").resolve()
    assert recovery_config(ray_train) == (tmp_path / "b" / "run" / "files" / "config.yaml").resolve()


def test_a_lone_recovery_checkpoint_needs_config(trained, tmp_path, capsys):
    files, latest = trained
    lone = tmp_path / "lone.pt"
    shutil.copy(latest / "state.pt", lone)
    assert main(["eval", str(lone), "--split", "val"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"prvrlab: error: {lone}: a recovery checkpoint holds no config") and "--config" in err
    assert main(["eval", str(lone), "--config", str(tmp_path / "none.yaml")]) == EXIT_BAD_INPUT
    assert capsys.readouterr().err.strip() == f"prvrlab: error: --config {tmp_path / 'none.yaml'}: file not found"
    assert main(["eval", str(lone), "--split", "val", "--config", str(files / "config.yaml")]) == 0
    blob = load_checkpoint(lone, config=files / "config.yaml")
    assert validate(blob["config"]) == validate(yaml.safe_load((files / "config.yaml").read_text()))


def test_config_is_refused_for_a_best_model_and_a_folder_needs_state_pt(trained, tmp_path, capsys):
    files, _ = trained
    assert main(["eval", str(files / "best_model.pt"), "--config", str(files / "config.yaml")]) == EXIT_BAD_INPUT
    assert "holds the config its weights were trained with" in capsys.readouterr().err
    assert main(["eval", str(tmp_path)]) == EXIT_BAD_INPUT
    assert capsys.readouterr().err.strip().startswith(f"prvrlab: error: {tmp_path}: a folder without state.pt or best_model.pt")


def test_eval_device_follows_the_request_then_the_run(tiny_root, tmp_path, monkeypatch):
    cpu_run = validate(small_raw(tiny_root, tmp_path))
    gpu_run = validate({**small_raw(tiny_root, tmp_path), "train": {**small_raw(tiny_root, tmp_path)["train"], "use_gpu": True}})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert eval_device(cpu_run) == torch.device("cpu")
    assert eval_device(gpu_run) == torch.device("cuda")
    assert eval_device(gpu_run, "cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert eval_device(gpu_run) == torch.device("cpu")


def test_the_model_is_evaluated_on_the_chosen_device(trained, monkeypatch):
    files, _ = trained
    seen = {}
    real = checkpoint_eval.eval_device

    def spy(cfg, requested=None):
        seen["requested"] = requested
        return real(cfg, requested)

    monkeypatch.setattr(checkpoint_eval, "eval_device", spy)
    result = evaluate_checkpoint(files / "best_model.pt", split="val", device="cpu")
    assert seen == {"requested": "cpu"} and result.num_queries > 0
    assert main(["eval", str(files / "best_model.pt"), "--split", "val", "--device", "cpu"]) == 0
    assert seen == {"requested": "cpu"}


def test_a_study_trials_tune_checkpoint_finds_that_trials_config(tmp_path):
    study = tmp_path / "search" / "s" / "20261202-185707"
    tune_trial = study / "tune" / "run_trial_9e05ce04_3_train_lr=0.0007_2026-12-02_18-57-22"
    state = tune_trial / "checkpoint_000001" / "state.pt"
    state.parent.mkdir(parents=True)
    state.write_bytes(b"")
    for trial in ("0db6e251", "9e05ce04", "9e05ce0"):  # the last: a name inside another id, not "_<id>_"
        (study / "trials" / trial / "files").mkdir(parents=True)
        (study / "trials" / trial / "files" / "config.yaml").write_text(f"name: {trial}\n")
    assert recovery_config(state) == study / "trials" / "9e05ce04" / "files" / "config.yaml"
    (study / "trials" / "9e05ce04" / "files" / "config.yaml").unlink()
    assert recovery_config(state) is None  # that trial's config is gone: not another trial's
    (study / "trials" / "9e05ce04" / "files" / "config.yaml").write_text("name: x\n")
    other = tmp_path / "elsewhere" / "run_trial_9e05ce04_3" / "checkpoint_000001" / "state.pt"
    other.parent.mkdir(parents=True)
    other.write_bytes(b"")
    assert recovery_config(other) is None  # not under a study's tune/


def test_a_runs_files_folder_is_its_best_model(trained, capsys):
    files, _ = trained
    assert main(["eval", str(files), "--split", "val"]) == 0
    by_folder = capsys.readouterr().out
    assert main(["eval", str(files / "best_model.pt"), "--split", "val"]) == 0
    assert by_folder == capsys.readouterr().out and "recovery checkpoint" not in by_folder
