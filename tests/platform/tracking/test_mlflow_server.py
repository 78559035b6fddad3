"""Training, an ablation and its report against an ``mlflow server`` (database + served artifacts).

The server is started by the test on 127.0.0.1 with an SQLite backend and its
artifact destination in a bucket of a local S3 endpoint (moto), as a lab's
tracking server keeps artifacts on the object store its checkpoints use;
clients reach artifacts only through the server (``mlflow-artifacts:`` URIs)
and need no S3 credentials.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from prvrlab.platform.cli import main
from prvrlab.platform.search.ablation import ablate
from prvrlab.platform.search.spec import load_ablation_spec
from prvrlab.platform.tracking.store import Tracker
from prvrlab.reports.report import report

from s3_helpers import bucket_keys, s3_endpoint
from search_helpers import REPO, TINY_OVERRIDES, tiny_spec

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``(uri, list of the artifact files' names in the bucket)`` of a running tracking server whose
    artifacts live in ``s3://lab/mlflow``; stopped after the module."""
    folder = tmp_path_factory.mktemp("mlflow_server")
    port = _free_port()
    mlflow_cli = Path(sys.executable).with_name("mlflow")
    cmd = [
        str(mlflow_cli), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
        "--backend-store-uri", f"sqlite:///{folder / 'db.sqlite'}",
        "--artifacts-destination", "s3://lab/mlflow",
    ]  # fmt: skip
    with s3_endpoint("lab") as s3:
        env = {**os.environ, **s3, "MLFLOW_S3_ENDPOINT_URL": s3["AWS_ENDPOINT_URL"]}
        log = open(folder / "server.log", "wb")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=folder, env=env, start_new_session=True)
        yield from _serve(proc, f"http://127.0.0.1:{port}", folder, log, lambda: {k.rsplit("/", 1)[-1] for k in bucket_keys(s3, "lab", "mlflow/")})


def _serve(proc, uri: str, folder: Path, log, artifact_files):
    """Wait for the server's health check, yield ``(uri, artifact_files)``, stop it."""
    deadline = time.monotonic() + 180
    try:
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"mlflow server did not start: {(folder / 'server.log').read_text()[-2000:]}")
            time.sleep(1)
        yield uri, artifact_files
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=60)
        log.close()
        import ray

        ray.shutdown()


def test_train_logs_runs_and_artifacts_through_the_server(server, tiny_root, tmp_path, monkeypatch):
    uri, artifacts = server
    monkeypatch.chdir(tmp_path)
    args = ["train", str(REPO / "configs" / "gmmformer_synth.yaml"), "--no-ray"]
    sets = {
        **TINY_OVERRIDES,
        "data.root": str(tiny_root),
        "data.synthesize": "null",
        "tracking.uri": uri,
        "tracking.experiment": "server_train",
        "tracking.storage_path": str(tmp_path / "results"),
    }
    for key, value in sets.items():
        text = "[" + ",".join(value) + "]" if isinstance(value, list) else str(value)
        args += ["--set", f"{key}={text}"]
    assert main(args) == 0

    tracker = Tracker(uri, "server_train")
    (run,) = tracker.client.search_runs([tracker.experiment_id])
    assert run.info.status == "FINISHED" and "val/sumr" in run.data.metrics
    assert run.info.artifact_uri.startswith("mlflow-artifacts:")  # served, not a path on this disk
    listed = {f.path for f in tracker.client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "ranks", "checkpoints"} <= listed
    assert {"config.yaml", "best_model.pt", "ranks_val.parquet"} <= artifacts()  # in the bucket
    assert not (tmp_path / "mlruns").exists() and not (tmp_path / "mlflow.db").exists()


def test_ablation_and_report_against_the_server(server, tiny_root, tmp_path, monkeypatch):
    uri, _ = server
    monkeypatch.chdir(tmp_path)
    variants = {"full": {}, "no_query_diverse": {"losses.query_diverse.weight": 0}}
    path = tiny_spec(tmp_path, tiny_root, name="abl_server", variants=variants, seeds=[0], concurrency=2)
    spec_text = path.read_text().replace(f"sqlite:///{tmp_path / 'mlflow.db'}", uri)
    path.write_text(spec_text)
    result = ablate(load_ablation_spec(path), echo=print)
    assert result.counts == {"finished": 2, "failed": 0, "missing": 0}

    tracker = Tracker(uri, "tests")
    runs = tracker.client.search_runs([tracker.experiment_id], max_results=100)
    (parent,) = [r for r in runs if r.data.tags.get("prvrlab.kind") == "ablation"]
    children = [r for r in runs if r.data.tags.get("prvrlab.kind") == "trial"]
    assert parent.info.status == "FINISHED" and len(children) == 2
    assert all(c.info.status == "FINISHED" for c in children)

    md = report(tracking_uri=uri, parent_id=parent.info.run_id, out=tmp_path / "report")
    text = md.read_text()
    assert "no_query_diverse" in text and "full" in text
    logged = {f.path for f in tracker.client.list_artifacts(parent.info.run_id, "report")}
    assert "report/report.md" in logged
    assert not (tmp_path / "mlflow.db").exists()
