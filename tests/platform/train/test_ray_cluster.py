"""`prvrlab train` next to a running Ray cluster: joined through RAY_ADDRESS, else a private one.

The head is started with ``ray start --head --block`` in its own temp folder and
stopped by terminating that process group, so only this test's cluster stops.
Without RAY_ADDRESS, RAY_TMPDIR points Ray's cluster discovery at that head, which
``ray.init()`` would join on its own; the command must start its own cluster instead.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from prvrlab.platform.tracking.store import Tracker
from cluster_helpers import NO_DRAIN, auth_env, free_ports, ray_bin, stop_head
from train_helpers import small_raw

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[3]


def wait_for_port(port: int, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, "ray start exited early"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    raise AssertionError("the Ray head did not come up")


@pytest.fixture(scope="module")
def ray_head():
    """A one-CPU head on 127.0.0.1; yields (address, RAY_TMPDIR of its temp folder)."""
    tmpdir = Path("/tmp") / f"rp{os.getpid()}"
    (port,) = free_ports(1)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | auth_env() | NO_DRAIN
    head = subprocess.Popen(
        [
            str(ray_bin() / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}",
            "--disable-usage-stats", "--include-dashboard=false", "--num-cpus=1", f"--temp-dir={tmpdir / 'ray'}",
        ],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        wait_for_port(port, head)
        time.sleep(2)
        yield f"127.0.0.1:{port}", tmpdir
    finally:
        stop_head(head)
        shutil.rmtree(tmpdir, ignore_errors=True)


@pytest.mark.parametrize("join", [True, False], ids=["RAY_ADDRESS", "private"])
def test_train_next_to_a_running_cluster(ray_head, tiny_root, tmp_path, join):
    address, tmpdir = ray_head
    raw = small_raw(tiny_root, tmp_path, epochs=1, num_workers=1)
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(raw))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=str(REPO), RAY_TMPDIR=str(tmpdir), **auth_env())
    if join:
        env["RAY_ADDRESS"] = address
    done = subprocess.run(
        [sys.executable, "-m", "prvrlab.platform.cli", "train", str(config)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert (f"joining the Ray cluster at {address}" in done.stderr) == join
    tracker = Tracker(raw["tracking"]["uri"], "tests")
    (run,) = tracker.client.search_runs([tracker.experiment_id])
    assert run.info.status == "FINISHED"
