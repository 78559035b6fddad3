"""After a driver kill, ``--resume`` leaves no child run RUNNING and never retrains an ended trial.

Tune saves its experiment state every few seconds, so a killed driver's saved state can
lag behind the MLflow runs: a trial that ended may be restored as unfinished (it replays
its recorded outcome), and a trial that had just started may be missing (its run is
closed KILLED as lost).  Both cases are built here directly, without racing a kill.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import mlflow

from prvrlab.platform.search.mlflow_callback import MlflowStudyCallback
from prvrlab.platform.storage import Mirror
from prvrlab.platform.search.outcome import STUDY_FILE, read_outcome
from prvrlab.platform.tracking.store import Tracker


def _study(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    study_dir = tmp_path / "study"
    study = SimpleNamespace(
        study_dir=str(study_dir), tracking_uri=uri, experiment="lost", trial_dir=lambda t: study_dir / "trials" / t / "files",
        storage="", push_files=lambda: Mirror(study_dir, None),  # local storage: nothing pushed
    )
    tracker = Tracker(uri, "lost")
    parent = tracker.start_run("search")
    runs = {t: tracker.start_run(f"trial {t}", parent_run_id=parent) for t in ("known", "lost", "ended")}
    study_dir.mkdir()
    (study_dir / STUDY_FILE).write_text(json.dumps({"parent": parent, "trials": runs, "closed": {"ended": "FINISHED"}}))
    tracker.end_run(runs["ended"], "FINISHED")
    return study, runs, mlflow.MlflowClient(uri)


def _restored(*trial_ids):
    """Tune's restored trials, none with a checkpoint."""
    no_checkpoint = SimpleNamespace(checkpoint_manager=SimpleNamespace(latest_checkpoint_result=None))
    return [SimpleNamespace(trial_id=t, run_metadata=no_checkpoint) for t in trial_ids]


def test_the_run_of_a_trial_missing_from_tunes_saved_state_is_closed_killed(tmp_path):
    study, runs, client = _study(tmp_path)
    callback = MlflowStudyCallback(study)
    restored = _restored("known", "ended")
    callback.on_step_begin(0, restored)
    lost = client.get_run(runs["lost"])
    assert lost.info.status == "KILLED" and lost.data.tags["prvrlab.stop_reason"].startswith("lost:")
    assert client.get_run(runs["known"]).info.status == "RUNNING"  # Tune will continue it
    assert client.get_run(runs["ended"]).info.status == "FINISHED"
    assert json.loads((tmp_path / "study" / STUDY_FILE).read_text())["closed"] == {"ended": "FINISHED", "lost": "KILLED"}
    callback.on_step_begin(1, restored[:1])  # checked once, at the first step only
    assert client.get_run(runs["ended"]).info.status == "FINISHED"


def test_an_ended_trial_records_its_outcome_before_its_run_closes_and_is_not_reopened(tmp_path):
    study, runs, client = _study(tmp_path)
    callback = MlflowStudyCallback(study)
    final = {"kind": "final", "val/sumr": 210.0, "epoch": 3, "config": {"train.lr": 1e-3}}
    trial = SimpleNamespace(trial_id="known", last_result=final, config={})
    callback.on_trial_complete(0, [trial], trial)
    assert read_outcome(study.trial_dir("known")) == {"kind": "final", "val/sumr": 210.0, "epoch": 3}
    assert client.get_run(runs["known"]).info.status == "FINISHED"

    replayed = SimpleNamespace(trial_id="ended", last_result=final, config={})
    callback.on_trial_restore(0, [replayed], replayed)
    callback.on_trial_result(0, [replayed], replayed, final)
    run = client.get_run(runs["ended"])
    assert run.info.status == "FINISHED" and "final/val/sumr" not in run.data.metrics  # not reopened, not relogged


def test_a_closed_trial_uploads_its_files_and_distributions(tmp_path):
    study, runs, client = _study(tmp_path)
    files = study.trial_dir("known")
    (files / "distributions").mkdir(parents=True)
    (files / "distributions" / "probe.score.json").write_text("{}")
    (files / "ranks_val.parquet").write_bytes(b"")
    MlflowStudyCallback(study).close_id("known", "FINISHED", {})
    logged = {f.path for folder in ("ranks", "distributions") for f in client.list_artifacts(runs["known"], folder)}
    assert logged == {"ranks/ranks_val.parquet", "distributions/probe.score.json"}


def test_running_child_runs_the_run_map_never_saved_are_adopted_or_closed(tmp_path):
    """With an object store the kill can cut the run map's push short: the map lacks runs MLflow has."""
    study, runs, client = _study(tmp_path)
    tracker = Tracker(study.tracking_uri, "lost")
    parent = json.loads((tmp_path / "study" / STUDY_FILE).read_text())["parent"]
    unsaved = {t: tracker.start_run(f"trial {t}", tags={"prvrlab.trial_id": t}, parent_run_id=parent) for t in ("gone", "tuned")}
    callback = MlflowStudyCallback(study)
    restored = _restored("known", "ended", "tuned")
    callback.on_step_begin(0, restored)
    gone = client.get_run(unsaved["gone"])
    assert gone.info.status == "KILLED" and gone.data.tags["prvrlab.stop_reason"].startswith("lost:")
    saved = json.loads((tmp_path / "study" / STUDY_FILE).read_text())
    assert saved["trials"]["gone"] == unsaved["gone"] and saved["closed"]["gone"] == "KILLED"
    assert saved["trials"]["tuned"] == unsaved["tuned"] and "tuned" not in saved["closed"]

    tuned = SimpleNamespace(trial_id="tuned", config={})
    callback.on_trial_start(0, restored, tuned)  # Tune's trial reattaches to its run: no second run
    assert client.get_run(unsaved["tuned"]).info.status == "RUNNING"
    children = client.search_runs([tracker.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent}'")
    assert len(children) == 5


def test_unmapped_child_runs_the_sentinel_already_closed_are_marked_lost_or_reattached(tmp_path):
    """The run sentinel closes a dead driver's RUNNING runs KILLED before ``--resume`` looks for them."""
    study, runs, client = _study(tmp_path)
    tracker = Tracker(study.tracking_uri, "lost")
    parent = json.loads((tmp_path / "study" / STUDY_FILE).read_text())["parent"]
    unsaved = {t: tracker.start_run(f"trial {t}", tags={"prvrlab.trial_id": t}, parent_run_id=parent) for t in ("gone", "tuned", "done")}
    died = {"prvrlab.status": "killed", "prvrlab.stop_reason": "its driver (pid 1) died without closing it"}
    for trial in ("gone", "tuned"):
        tracker.set_tags(unsaved[trial], died)
        tracker.end_run(unsaved[trial], "KILLED")
    tracker.end_run(unsaved["done"], "FINISHED")
    callback = MlflowStudyCallback(study)
    restored = _restored("known", "ended", "tuned", "done")
    callback.on_step_begin(0, restored)
    gone = client.get_run(unsaved["gone"])
    assert gone.info.status == "KILLED" and gone.data.tags["prvrlab.stop_reason"].startswith("lost:")
    saved = json.loads((tmp_path / "study" / STUDY_FILE).read_text())
    assert {t: saved["trials"][t] for t in unsaved} == unsaved
    assert saved["closed"] == {"ended": "FINISHED", "lost": "KILLED", "gone": "KILLED", "done": "FINISHED"}

    tuned = SimpleNamespace(trial_id="tuned", config={})
    callback.on_trial_start(0, restored, tuned)  # reattached and reopened, its stop reason dropped
    run = client.get_run(unsaved["tuned"])
    assert run.info.status == "RUNNING" and run.data.tags["prvrlab.status"] == "resumed"
    assert "prvrlab.stop_reason" not in run.data.tags
    callback.on_trial_start(0, restored, SimpleNamespace(trial_id="done", config={}))  # ended: not reopened
    assert client.get_run(unsaved["done"]).info.status == "FINISHED"
    children = client.search_runs([tracker.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent}'")
    assert len(children) == 6
