"""`ray job stop` of a submitted search leaves no MLflow run RUNNING.

Ray's job supervisor sends SIGTERM to the job's processes and SIGKILL
``RAY_JOB_STOP_WAIT_TIME_S`` (3 s) later; at the SIGTERM the study starts a
detached process that closes its runs KILLED, which the SIGKILL does not reach.
"""

from __future__ import annotations

import json
import time

import pytest

from cluster_helpers import REPO, head_node
from search_helpers import study_runs

pytestmark = pytest.mark.slow


def _running_child_with_an_epoch(tmp_path) -> bool:
    if not (tmp_path / "mlflow.db").is_file():
        return False
    try:
        _, children = study_runs(tmp_path)
    except Exception:  # the store is being created by the job
        return False
    return any(c.info.status == "RUNNING" and "train/loss" in c.data.metrics for c in children)


def test_ray_job_stop_closes_the_parent_and_children(tiny_root, tmp_path):
    job = f"prvrlab-stop-{tmp_path.name}"
    runtime_env = {
        "excludes": ["data/", ".venv/", "mlflow.db", "results/", "mlruns/", "*.pt"],
        "env_vars": {"PRVRLAB_HOME": str(tmp_path)},
    }
    with head_node(num_cpus=2) as head:
        submitted = head.submit(
            "--working-dir", ".", "--no-wait", "--submission-id", job,
            "--runtime-env-json", json.dumps(runtime_env), "--",
            "prvrlab", "search", "search_spaces/gmmformer_synth_tiny.yaml",
            "--set", f"data.root={tiny_root}", "--set", "tracking.experiment=tests", "--set", "train.epochs=60",
            cwd=REPO, timeout=120,
        )  # fmt: skip
        assert submitted.returncode == 0, submitted.stdout + submitted.stderr
        deadline = time.monotonic() + 400
        while not _running_child_with_an_epoch(tmp_path):
            status = head.ray("job", "status", "--address", head.url, job, timeout=60).stdout
            assert "FAILED" not in status and "SUCCEEDED" not in status, status
            assert time.monotonic() < deadline, "no trial reported an epoch in time"
            time.sleep(3)
        stopped = head.ray("job", "stop", "--address", head.url, job, timeout=120)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        status = head.ray("job", "status", "--address", head.url, job, timeout=60).stdout
        assert "stopped" in status.lower(), status
        logs = head.ray("job", "logs", "--address", head.url, job, timeout=60).stdout

    deadline = time.monotonic() + 90  # the detached closer may still be importing MLflow
    while True:
        parents, children = study_runs(tmp_path)
        (parent,) = parents
        if parent.info.status != "RUNNING" or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert parent.info.status == "KILLED", logs[-3000:]
    assert parent.data.tags.get("prvrlab.stop_reason") == "stopped by SIGTERM"
    assert children and all(c.info.status in ("KILLED", "FINISHED") for c in children), [c.info.status for c in children]
    killed = [c for c in children if c.info.status == "KILLED"]
    assert killed and all(c.data.tags.get("prvrlab.stop_reason") for c in killed)
