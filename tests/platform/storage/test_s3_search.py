"""A search with its study on a local S3 endpoint (moto): killed driver, resume from the bucket alone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from s3_helpers import bucket_keys, s3_client, s3_endpoint
from search_helpers import metric_history, study_runs, tiny_spec

pytestmark = pytest.mark.slow


def _closed_in_bucket(env: dict[str, str], prefix: str) -> int:
    """Trials closed in the ``study.json`` the driver pushed to the bucket."""
    client = s3_client(env)
    for key in bucket_keys(env, "lab", prefix):
        if key.endswith("/study.json"):
            return len(json.loads(client.get_object(Bucket="lab", Key=key)["Body"].read()).get("closed", {}))
    return 0


def test_search_resumes_from_the_bucket_after_the_driver_is_killed(tiny_root, tmp_path):
    path = tiny_spec(tmp_path, tiny_root, name="s3resume")
    spec = yaml.safe_load(path.read_text())
    spec["overrides"]["tracking.storage_path"] = "s3://lab/studies"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    cmd = [sys.executable, "-m", "prvrlab.platform.cli", "search", str(path), "--set", "train.epochs=6"]
    prefix = "studies/search/s3resume/"
    with s3_endpoint("lab") as s3:
        env = {**os.environ, **s3, "PYTHONUNBUFFERED": "1", "PRVRLAB_STAGING": str(tmp_path / "first-machine")}
        log = (tmp_path / "first.log").open("w")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.time() + 600
        try:
            while _closed_in_bucket(s3, prefix) < 1:
                assert proc.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
                assert time.time() < deadline, "no trial finished in time"
                time.sleep(0.2)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        assert not (tmp_path / "results").exists()
        _, before = study_runs(tmp_path)
        finished_before = {c.data.tags["prvrlab.trial_id"] for c in before if c.info.status == "FINISHED"}
        assert finished_before and len(finished_before) < 3

        # another machine: nothing staged locally, everything comes from the bucket; the killed driver recorded
        # no state, so whoever can write the bucket could have written it: resumed only when the user says so
        env["PRVRLAB_STAGING"] = str(tmp_path / "second-machine")
        refused = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, env=env, timeout=200)
        assert refused.returncode == 2 and "PRVRLAB_TRUST_STUDY_STATE=1" in refused.stderr, refused.stderr[-2000:]
        env["PRVRLAB_TRUST_STUDY_STATE"] = "1"
        done = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, env=env, timeout=500)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert "trusting it (PRVRLAB_TRUST_STUDY_STATE=1)" in done.stdout + done.stderr
        assert "resuming search 's3resume' from" in done.stdout
        for trial_id in finished_before:  # ended trials are not rerun, at most their recorded result replayed
            assert f"start  {trial_id}" not in done.stdout, done.stdout
        parents, children = study_runs(tmp_path)
        assert len(parents) == 1 and parents[0].info.status == "FINISHED"
        # a trial started just before the kill may be missing from Tune's saved state: closed KILLED ("lost")
        lost = [c for c in children if c.data.tags.get("prvrlab.stop_reason", "").startswith("lost:")]
        assert len(lost) <= 1 and all(c.info.status == "KILLED" for c in lost)
        children = [c for c in children if c.info.run_id not in {r.info.run_id for r in lost}]
        seen = [(c.data.tags["prvrlab.trial_id"], c.info.status, c.data.tags.get("prvrlab.stop_reason")) for c in children]
        assert len({c.data.tags["prvrlab.trial_id"] for c in children}) == len(children), seen  # one run per trial
        # Two races of a kill inside the bucket's sync window, both seen in loaded full-suite runs: Tune's
        # searcher state one suggestion behind its trial list (a trial over the budget was sampled; the
        # restored counter now follows the trial list), and the run map's push cut short (a started
        # trial's run was left RUNNING outside the map; it is now adopted, or closed as lost).
        assert len(children) == 3, (seen, done.stdout[-3000:])
        assert all(c.info.status == "FINISHED" for c in children), [c.info.status for c in children]
        for child in children:
            steps = [m.step for m in metric_history(tmp_path, child.info.run_id, "val/sumr")]
            assert steps == list(range(1, 7)), steps  # every epoch logged once: no retrained or replayed epoch

        keys = [k[len(prefix):].split("/", 1)[1] for k in bucket_keys(s3, "lab", prefix) if not k.endswith("/")]
        assert {"study.json", "state.sha256", "best_config.yaml", "study.log"} <= set(keys), keys
        assert any(k.startswith("tune/") and "experiment_state" in k for k in keys), keys
        for child in children:
            trial = child.data.tags["prvrlab.trial_id"]
            assert {f"trials/{trial}/files/{f}" for f in ("best_model.pt", "ranks_val.parquet", "outcome.json", "config.yaml")} <= set(keys)

        # the recorded state guards the bucket too: a changed Tune file is refused before anything is unpickled
        stamp = _stamp(s3, prefix)
        (state,) = [k for k in keys if k.startswith("tune/") and k.endswith(".pkl")][:1]
        s3_client(s3).put_object(Bucket="lab", Key=f"{prefix}{stamp}/{state}", Body=b"planted")
        env["PRVRLAB_STAGING"] = str(tmp_path / "third-machine")
        refused = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, env=env, timeout=200)
        assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
        assert f"{state} was modified since the driver recorded" in refused.stderr, refused.stderr


def _stamp(s3: dict, prefix: str) -> str:
    """The one submission folder of the study under ``prefix`` in the bucket."""
    (stamp,) = {k[len(prefix):].split("/", 1)[0] for k in bucket_keys(s3, "lab", prefix) if not k.endswith("/")}
    return stamp
