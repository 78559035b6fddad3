"""`ray job submit` end to end: a local head node on 127.0.0.1, the tiny search, MLflow checks.

The head node comes from ``cluster_helpers.head_node`` (every port free, stopped
by process group, so that only the cluster this test started is stopped).
"""

from __future__ import annotations

import json

import pytest

from prvrlab.platform.tracking.store import git_commit

from cluster_helpers import head_node
from search_helpers import REPO, study_runs

pytestmark = pytest.mark.slow


def test_ray_job_submit_runs_the_tiny_search(tiny_root, tmp_path):
    with head_node(num_cpus=2) as head:
        commit = git_commit(REPO)  # captured where the job is submitted: Ray's copy has no .git
        runtime_env = {
            "excludes": ["data/", ".venv/", "mlflow.db", "results/", "mlruns/", "*.pt"],
            "env_vars": {"PRVRLAB_HOME": str(tmp_path), "PRVRLAB_GIT_COMMIT": commit},
        }
        done = head.submit(
            "--working-dir", ".", "--runtime-env-json", json.dumps(runtime_env), "--",
            "prvrlab", "search", "search_spaces/gmmformer_synth_tiny.yaml",
            "--set", f"data.root={tiny_root}", "--set", "tracking.experiment=tests",
            cwd=REPO, timeout=480,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
        assert "best trial" in done.stdout

    # PRVRLAB_HOME put the default store and results in tmp_path, not in the job's temporary working dir
    assert (tmp_path / "mlflow.db").is_file()
    parents, children = study_runs(tmp_path)
    (parent,) = parents
    assert parent.info.status == "FINISHED"
    assert len(children) == 3
    assert all(c.info.status == "FINISHED" for c in children), [c.info.status for c in children]
    assert all(c.data.params["train.num_workers"] == "2" for c in children)
    # provenance: the submitted commit and project-relative paths, not Ray's temporary copy
    assert commit != "unknown"
    assert {r.data.tags["git_commit"] for r in [parent, *children]} == {commit}
    assert parent.data.params["spec.base_config"] == "configs/gmmformer_synth.yaml"
    assert parent.data.tags["prvrlab.spec"] == "search_spaces/gmmformer_synth_tiny.yaml"
    assert list((tmp_path / "results" / "search" / "gmmformer_synth_tiny").glob("*/best_config.yaml"))
