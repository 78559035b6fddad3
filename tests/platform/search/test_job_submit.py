"""`ray job submit` end to end: a local head node on 127.0.0.1, the tiny search, MLflow checks.

The head node is started with ``ray start --head --block`` as a child process
of this test and stopped by terminating that process group, so that only the
cluster this test started is stopped (``ray stop`` would stop every Ray on
the machine).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from prvrlab.platform.tracking.store import git_commit

from search_helpers import REPO, study_runs

pytestmark = pytest.mark.slow
BIN = Path(os.environ.get("VIRTUAL_ENV", "")) / "bin" if os.environ.get("VIRTUAL_ENV") else REPO / ".venv" / "bin"


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def auth_env() -> dict[str, str]:
    """The same RAY_AUTH_MODE for `ray start` and `ray job submit` (REFERENCE §6)."""
    if (Path.home() / ".ray" / "auth_token").exists():
        return {"RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token")}
    return {}


def wait_for_dashboard(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, "ray start exited early"
        try:
            with urllib.request.urlopen(f"{url}/api/version", timeout=2):
                return
        except urllib.error.HTTPError:
            return  # answering (401 with token authentication on)
        except OSError:
            time.sleep(1)
    raise AssertionError("the Ray dashboard did not come up")


def test_ray_job_submit_runs_the_tiny_search(tiny_root, tmp_path):
    bin_dir = BIN if (BIN / "ray").exists() else Path(shutil.which("ray")).parent
    port, dash, client = free_ports(3)
    env = {
        **os.environ,
        **auth_env(),
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "RAY_ADDRESS": "",
    }
    env.pop("RAY_ADDRESS")
    temp_dir = Path("/tmp") / f"ray_prvrlab_{os.getpid()}"
    head = subprocess.Popen(
        [
            str(bin_dir / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
            "--dashboard-host=127.0.0.1", "--disable-usage-stats", f"--port={port}",
            f"--dashboard-port={dash}", f"--ray-client-server-port={client}", "--num-cpus=2",
            f"--temp-dir={temp_dir}",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{dash}"
    try:
        wait_for_dashboard(url, head)
        commit = git_commit(REPO)  # captured where the job is submitted: Ray's copy has no .git
        runtime_env = {
            "excludes": ["data/", ".venv/", "mlflow.db", "results/", "mlruns/", "*.pt"],
            "env_vars": {"PRVRLAB_HOME": str(tmp_path), "PRVRLAB_GIT_COMMIT": commit},
        }
        submit = [
            str(bin_dir / "ray"), "job", "submit", "--address", url, "--working-dir", ".",
            "--runtime-env-json", json.dumps(runtime_env), "--",
            "prvrlab", "search", "search_spaces/gmmformer_synth_tiny.yaml",
            "--set", f"data.root={tiny_root}",
            "--set", "tracking.experiment=tests",
        ]
        done = subprocess.run(submit, cwd=REPO, env=env, capture_output=True, text=True, timeout=480)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
        assert "best trial" in done.stdout
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
        shutil.rmtree(temp_dir, ignore_errors=True)

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
