"""Passwords in URLs are not logged as run params (every reader of the tracking store sees params)."""

from __future__ import annotations

from prvrlab.platform.tracking.store import Tracker, redact_credentials


def test_url_passwords_are_masked_and_nothing_else_changes():
    assert redact_credentials("https://alice:s3cret@mlflow.lab:5000") == "https://alice:***@mlflow.lab:5000"
    assert redact_credentials("postgresql://u:p@db/mlflow and s3://k:v@minio/b") == "postgresql://u:***@db/mlflow and s3://k:***@minio/b"
    for kept in ("http://127.0.0.1:5000", "sqlite:////tmp/x.db", "https://alice@h/x", "s3://bucket/a:b", "a:b@c"):
        assert redact_credentials(kept) == kept


def test_logged_params_carry_no_password(tmp_path):
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "redact")
    run_id = tracker.start_run("r")
    tracker.log_params(run_id, {"tracking.uri": "https://alice:s3cret@mlflow.lab", "spec.overrides": {"tracking.uri": "https://bob:pw@h"}, "train.lr": 0.001})
    params = tracker.client.get_run(run_id).data.params
    assert params["tracking.uri"] == "https://alice:***@mlflow.lab"
    assert params["spec.overrides"] == "{'tracking.uri': 'https://bob:***@h'}"
    assert params["train.lr"] == "0.001"
    tracker.end_run(run_id, "FINISHED")
