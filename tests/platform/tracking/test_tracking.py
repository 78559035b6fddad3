"""MLflow helpers: absolute URIs, run lifecycle."""


import pytest

from prvrlab.platform.config import ConfigError
from prvrlab.platform.tracking.store import Tracker, numeric_metrics
from prvrlab.platform.tracking.uri import resolve_tracking_uri


def test_default_uri_is_absolute_sqlite_in_cwd(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert resolve_tracking_uri(None, tmp_path) == f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"


def test_env_uri_honoured_and_relative_paths_made_absolute(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///stores/x.db")
    assert resolve_tracking_uri(None, tmp_path) == f"sqlite:///{tmp_path.resolve() / 'stores/x.db'}"
    assert resolve_tracking_uri("http://127.0.0.1:5000", tmp_path) == "http://127.0.0.1:5000"
    assert resolve_tracking_uri("sqlite:////abs/m.db", tmp_path) == "sqlite:////abs/m.db"


def test_a_path_without_scheme_is_refused_naming_where_it_came_from(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="^--tracking-uri: 'mlruns' is a file path; use sqlite:///"):
        resolve_tracking_uri("mlruns", tmp_path, key="--tracking-uri")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", str(tmp_path / "m.db"))
    with pytest.raises(ConfigError, match=r"^\$MLFLOW_TRACKING_URI: '.*m\.db' is a file path"):
        resolve_tracking_uri(None, tmp_path)


def test_numeric_metrics_drops_strings_bools_and_nonfinite():
    got = numeric_metrics({"a": 1, "b": 2.5, "kind": "epoch", "flag": True, "nan": float("nan")})
    assert got == {"a": 1.0, "b": 2.5}


def test_run_lifecycle_and_parent_link(tmp_path):
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    tracker = Tracker(uri, "exp")
    parent = tracker.start_run("parent")
    child = tracker.start_run("child", tags={"backbone": "x"}, parent_run_id=parent)
    tracker.log_params(child, {"train.lr": 0.1, "model.sigmas": [1.0, float("inf")]})
    tracker.log_metrics(child, {"val/sumr": 12.5, "kind": "epoch"}, step=3)
    tracker.end_run(child, "FINISHED")
    tracker.end_run(parent, "KILLED")
    run = tracker.client.get_run(child)
    assert run.info.status == "FINISHED"
    assert run.data.tags["mlflow.parentRunId"] == parent
    assert run.data.params["train.lr"] == "0.1"
    assert run.data.metrics["val/sumr"] == 12.5
    assert tracker.client.get_run(parent).info.status == "KILLED"
    with pytest.raises(ValueError):
        tracker.end_run(child, "RUNNING")


def test_artifacts_go_beside_the_sqlite_store_not_into_the_working_dir(tmp_path):
    from prvrlab.platform.tracking.store import Tracker

    tracker = Tracker(f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}", "a/b")
    location = tracker.client.get_experiment(tracker.experiment_id).artifact_location
    assert location == (tmp_path / "store" / "mlruns" / "a_b").as_uri()


def test_an_error_from_a_trackers_client_names_its_store_and_the_innermost_store_wins(tmp_path, monkeypatch):
    """The CLI names the store of a store error from ``store_uri``; an error the client never raised is unmarked."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from prvrlab.platform.tracking.store import store_uri

    outer = Tracker(f"sqlite:///{tmp_path / 'outer.db'}", "e")
    inner = Tracker(f"sqlite:///{tmp_path / 'inner.db'}", "e")
    run_id = outer.start_run("r")

    def failing(self, *args, **kwargs):
        raise MlflowException("the store went away")

    monkeypatch.setattr(MlflowClient, "log_batch", failing)
    with pytest.raises(MlflowException) as caught:
        outer.set_tags(run_id, {"a": "b"})
    assert store_uri(caught.value) == outer.uri

    def nested(self, *args, **kwargs):  # the outer store's call fails inside the inner store's
        inner.set_tags(run_id, {"a": "b"})

    monkeypatch.setattr(MlflowClient, "set_terminated", nested)
    with pytest.raises(MlflowException) as caught:
        outer.end_run(run_id, "FINISHED")
    assert store_uri(caught.value) == inner.uri != outer.uri
    assert store_uri(ValueError("not from a client")) is None
    assert outer.client.tracking_uri == outer.uri  # attributes pass through unchanged
    import copy

    assert copy.copy(outer.client).tracking_uri == outer.uri  # a copy made without __init__ does not recurse


@pytest.mark.parametrize("error, status", [(ValueError("bad"), "FAILED"), (KeyboardInterrupt(), "KILLED")])
def test_end_stopped_ends_a_run_whose_tags_fail_and_warns_when_the_store_cannot_end_it(tmp_path, monkeypatch, capsys, error, status):
    from mlflow.exceptions import MlflowException

    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "e")
    first, second = tracker.start_run("a"), tracker.start_run("b")

    def failing(*args, **kwargs):
        raise MlflowException("the store went away")

    monkeypatch.setattr(tracker, "set_tags", failing)
    tags = {"failed_tags": {"error": "x"}, "killed_tags": {"prvrlab.status": "killed"}}
    assert tracker.end_stopped(first, error, **tags) == status  # its tags failed: ended all the same
    assert tracker.client.get_run(first).info.status == status
    monkeypatch.setattr(tracker, "end_run", failing)
    assert tracker.end_stopped(second, error, **tags) is None
    assert tracker.client.get_run(second).info.status == "RUNNING"
    warnings = [ln for ln in capsys.readouterr().err.splitlines() if "warning" in ln]
    assert len(warnings) == 3 and f"could not end run {second}" in warnings[-1]


def test_a_deleted_experiment_is_named_under_its_key_with_how_to_restore_it(tmp_path):
    """MLflow's "The experiment 1 must be in the 'active' state" had been reported as a bad tracking.uri."""
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    tracker = Tracker(uri, "gone")
    tracker.client.delete_experiment(tracker.experiment_id)
    with pytest.raises(ConfigError) as caught:
        Tracker(uri, "gone")
    assert str(caught.value) == (
        f"tracking.experiment 'gone': deleted in the MLflow store {uri} (id {tracker.experiment_id}); restore it "
        f"(MLFLOW_TRACKING_URI={uri} mlflow experiments restore --experiment-id {tracker.experiment_id}) or name another")
    tracker.client.restore_experiment(tracker.experiment_id)
    assert Tracker(uri, "gone").experiment_id == tracker.experiment_id
