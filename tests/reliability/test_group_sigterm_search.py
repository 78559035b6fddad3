"""SIGTERM to a search's whole process group (``timeout``, a batch scheduler at its time limit,
``kill -- -PGID``): the command stops as on a SIGTERM of its own, with the resume hint, and the local
Ray cluster it started (whose daemons no longer share its process group) goes with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from search_helpers import study_runs, tiny_spec


def _wait_for(path, text: str, proc: subprocess.Popen, limit_s: float = 240) -> None:
    deadline = time.monotonic() + limit_s
    while text not in path.read_text():
        assert proc.poll() is None, path.read_text()[-3000:]
        assert time.monotonic() < deadline, f"no {text!r} in time: " + path.read_text()[-3000:]
        time.sleep(0.3)


@pytest.mark.slow
def test_a_process_group_sigterm_stops_a_search_with_its_resume_hint(tiny_root, tmp_path):
    import ray  # noqa: F401  (puts Ray's bundled psutil on sys.path)
    import psutil

    spec = tiny_spec(tmp_path, tiny_root, name="grouped")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONUNBUFFERED"] = "1"
    log = tmp_path / "search.log"
    cmd = [sys.executable, "-m", "prvrlab.platform.cli", "search", str(spec), "--set", "train.epochs=40"]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        _wait_for(log, " epoch 1 ", proc)
        daemons = psutil.Process(proc.pid).children(recursive=True)
        assert any("gcs_server" in " ".join(p.cmdline()) for p in daemons), [p.name() for p in daemons]
        os.killpg(proc.pid, signal.SIGTERM)  # the whole group, as `timeout` or a scheduler sends it
        rc = proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            for child in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
                child.kill()
    text = log.read_text()
    # before: Ray's daemons shut down with the group, Tune's teardown waited on them until the
    # command's 30 s guard, which exited 143 without the hint
    assert "still stopping" not in text, text[-3000:]
    assert rc == 130, (rc, text[-3000:])
    assert f"continue with  prvrlab search {spec} --set train.epochs=40 --resume" in text, text[-3000:]
    parents, children = study_runs(tmp_path)
    assert [p.info.status for p in parents] == ["KILLED"]
    assert children and "RUNNING" not in {c.info.status for c in children}
    _, alive = psutil.wait_procs(daemons, timeout=20)
    assert not alive, [p.name() for p in alive]
