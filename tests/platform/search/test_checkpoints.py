"""A resumed trial whose saved checkpoint is gone restores from what is left, not a missing folder.

The state is built as a driver killed between Tune's checkpoint deletion and its next experiment
state save leaves it: the registered ``checkpoint_000001`` deleted, the newer ``checkpoint_000002``
written but unregistered. Tune's own existence check (the one its restore raises on) decides.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace

import mlflow
import pytest
from ray.train import Checkpoint, CheckpointConfig
from ray.train._internal.session import _TrainingResult
from ray.train._internal.storage import StorageContext, _exists_at_fs_path
from ray.tune import Callback
from ray.tune.experiment import Trial

from prvrlab.platform.search.checkpoints import repair_checkpoints
from prvrlab.platform.search.mlflow_callback import MlflowStudyCallback
from prvrlab.platform.search.outcome import STUDY_FILE
from prvrlab.platform.storage import Mirror
from prvrlab.platform.tracking.store import Tracker


def _trial(root: Path, trial_id: str) -> Trial:
    storage = StorageContext(storage_path=str(root), experiment_dir_name="tune", trial_dir_name=f"trial_{trial_id}")
    return Trial("fn", config={}, trial_id=trial_id, storage=storage, checkpoint_config=CheckpointConfig(num_to_keep=1), stub=True)


def _checkpoint(trial: Trial, index: int, *, register: bool) -> Path:
    """Write ``checkpoint_<index>`` and its result.json row, as a report with a checkpoint does."""
    path = Path(trial.storage.trial_fs_path) / f"checkpoint_{index:06d}"
    path.mkdir(parents=True)
    (path / "state.pt").write_text(str(index))
    row = {"training_iteration": index + 1, "epoch": index + 1, "checkpoint_dir_name": path.name}
    with open(Path(trial.storage.trial_fs_path) / "result.json", "a") as out:
        out.write(json.dumps(row) + "\n")
    if register:
        trial.on_checkpoint(_TrainingResult(checkpoint=Checkpoint(str(path)), metrics=row))
    return path


def _killed_between_delete_and_save(trial: Trial) -> None:
    """Registered 0 then 1 (0 deleted by num_to_keep), then 2 written and 1 deleted, state never saved."""
    _checkpoint(trial, 0, register=True)
    registered = _checkpoint(trial, 1, register=True)
    _checkpoint(trial, 2, register=False)
    shutil.rmtree(registered)
    with open(Path(trial.storage.trial_fs_path) / "result.json", "a") as out:
        out.write('{"training_iteration": 4, "checkpoint_dir_na')  # a row cut short by the kill


def _restorable(trial: Trial) -> bool:
    latest = trial.latest_checkpoint_result.checkpoint
    return _exists_at_fs_path(latest.filesystem, latest.path)


def test_a_trial_whose_registered_checkpoint_is_gone_restores_from_the_newest_one_left(tmp_path):
    trial = _trial(tmp_path, "a")
    _killed_between_delete_and_save(trial)
    (Path(trial.storage.trial_fs_path) / "checkpoint_000000").mkdir()  # an older one left behind is not picked
    assert not _restorable(trial)  # what Tune's restore would raise on

    notes = repair_checkpoints([trial])
    latest = trial.latest_checkpoint_result
    assert _restorable(trial) and Path(latest.checkpoint.path).name == "checkpoint_000002"
    assert (Path(latest.checkpoint.path) / "state.pt").read_text() == "2"
    assert latest.metrics["training_iteration"] == 3  # that report's row: iterations go on from there
    assert trial.storage.current_checkpoint_index == 2  # the next report writes checkpoint_000003
    assert trial.run_metadata.checkpoint_manager.best_checkpoint_result is latest
    assert notes == {"a": "checkpoint_000001 was gone on resume: resumed from checkpoint_000002"}


def test_a_trial_with_no_checkpoint_left_trains_again_from_the_start(tmp_path):
    trial = _trial(tmp_path, "b")
    shutil.rmtree(_checkpoint(trial, 0, register=True))
    notes = repair_checkpoints([trial])
    assert trial.latest_checkpoint_result is None  # Tune then starts it without a restore
    assert trial.run_metadata.checkpoint_manager.best_checkpoint_result is None
    assert "trained again from the start" in notes["b"]


def test_trials_whose_checkpoint_exists_or_that_have_none_are_left_alone(tmp_path):
    kept, fresh = _trial(tmp_path, "c"), _trial(tmp_path, "d")
    _checkpoint(kept, 0, register=True)
    _checkpoint(kept, 1, register=False)  # newer but unregistered: the registered one still exists
    before = kept.latest_checkpoint_result
    assert repair_checkpoints([kept, fresh]) == {}
    assert kept.latest_checkpoint_result is before and kept.storage.current_checkpoint_index == 0
    assert fresh.latest_checkpoint_result is None


def test_the_resumed_run_is_tagged_with_what_was_done(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    study_dir = tmp_path / "study"
    study_dir.mkdir()
    study = SimpleNamespace(
        study_dir=str(study_dir), tracking_uri=uri, experiment="repair", trial_dir=lambda t: study_dir / "trials" / t / "files",
        storage="", push_files=lambda: Mirror(study_dir, None),
    )
    tracker = Tracker(uri, "repair")
    parent = tracker.start_run("search")
    runs = {t: tracker.start_run(f"trial {t}", parent_run_id=parent) for t in ("a", "c")}
    for run_id in runs.values():
        tracker.end_run(run_id, "KILLED")
    (study_dir / STUDY_FILE).write_text(json.dumps({"parent": parent, "trials": runs, "closed": {}}))
    repaired, kept = _trial(tmp_path, "a"), _trial(tmp_path, "c")
    _killed_between_delete_and_save(repaired)
    _checkpoint(kept, 0, register=True)

    callback = MlflowStudyCallback(study)
    callback.on_step_begin(0, [repaired, kept])
    assert _restorable(repaired)  # before any trial starts
    for trial in (repaired, kept):
        callback.on_trial_restore(0, [repaired, kept], trial)
    client = mlflow.MlflowClient(uri)
    tags = client.get_run(runs["a"]).data.tags
    assert tags["prvrlab.status"] == "resumed"
    assert tags["prvrlab.resume_note"] == "checkpoint_000001 was gone on resume: resumed from checkpoint_000002"
    assert "prvrlab.resume_note" not in client.get_run(runs["c"]).data.tags


class _Repair(Callback):
    """The resume hook of the study's MLflow callback, alone: repair at the first step."""

    def __init__(self) -> None:
        self.notes: dict[str, str] | None = None

    def on_step_begin(self, iteration, trials, **info) -> None:
        if self.notes is None:
            self.notes = repair_checkpoints(trials)


def _counting(config):
    """Counts to 3, one checkpoint a report, from its checkpoint's count; its first run dies after 2."""
    from ray import tune

    start = 0
    checkpoint = tune.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            start = int((Path(folder) / "n").read_text())
    for n in range(start + 1, 4):
        with tempfile.TemporaryDirectory() as folder:
            (Path(folder) / "n").write_text(str(n))
            tune.report({"n": n, "start": start}, checkpoint=Checkpoint.from_directory(folder))
        marker = Path(config["marker"])
        if n == 2 and not marker.exists():
            marker.touch()
            raise RuntimeError("the driver was killed")


@pytest.mark.slow
def test_tune_restores_a_repaired_trial_instead_of_failing_it(tmp_path):
    """Through Tune itself: the repair runs before the restore it would raise in."""
    import sys

    import ray
    from ray import cloudpickle, tune

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # a test module workers cannot import
    ray.init(num_cpus=1, include_dashboard=False, address="local", log_to_driver=False)
    try:
        run_config = tune.RunConfig(
            name="tune", storage_path=str(tmp_path), verbose=0, checkpoint_config=tune.CheckpointConfig(num_to_keep=1)
        )
        tune.Tuner(_counting, param_space={"marker": str(tmp_path / "died")}, run_config=run_config).fit()
        (trial_dir,) = (tmp_path / "tune").glob("_counting_*")
        registered = trial_dir / "checkpoint_000001"
        shutil.copytree(registered, trial_dir / "checkpoint_000002")  # written, then the kill before the state save
        shutil.rmtree(registered)

        repair = _Repair()
        tuner = tune.Tuner.restore(str(tmp_path / "tune"), trainable=_counting, resume_errored=True)
        tuner._local_tuner.get_run_config().callbacks = [repair]
        (result,) = tuner.fit()
        assert result.error is None, result.error
        assert result.metrics["n"] == 3 and result.metrics["start"] == 2
        assert list(repair.notes.values()) == ["checkpoint_000001 was gone on resume: resumed from checkpoint_000002"]
    finally:
        ray.shutdown()
