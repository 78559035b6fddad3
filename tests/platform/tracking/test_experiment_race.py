"""Two commands starting on a new store at once: the one whose experiment creation loses the race uses the
experiment the other made (it had failed with 'UNIQUE constraint failed: experiments...')."""

from __future__ import annotations

from mlflow.tracking import MlflowClient

from prvrlab.platform.tracking.store import Tracker


def test_an_experiment_made_meanwhile_is_used(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    first = Tracker(uri, "race")  # the other command, a moment earlier
    real = MlflowClient.get_experiment_by_name
    calls = []

    def not_yet(self, name):  # this command looked before the other made it
        calls.append(name)
        return None if len(calls) == 1 else real(self, name)

    monkeypatch.setattr(MlflowClient, "get_experiment_by_name", not_yet)
    second = Tracker(uri, "race")
    assert second.experiment_id == first.experiment_id and len(calls) == 2
    run_id = second.start_run("r")
    second.end_run(run_id, "FINISHED")
    assert second.client.get_run(run_id).info.experiment_id == first.experiment_id
