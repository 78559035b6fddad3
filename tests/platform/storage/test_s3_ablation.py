"""An ablation with its study on a local S3 endpoint (moto), then its report: the CLI end to end."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from s3_helpers import bucket_keys, s3_endpoint
from search_helpers import study_runs, tiny_spec

pytestmark = pytest.mark.slow


def test_ablation_on_s3_then_report_and_resubmission_skips_the_cells(tiny_root, tmp_path):
    variants = {"full": {}, "no_query_diverse": {"losses.query_diverse.weight": 0}}
    path = tiny_spec(tmp_path, tiny_root, name="s3abl", variants=variants, seeds=[0], concurrency=1)
    spec = yaml.safe_load(path.read_text())
    spec["overrides"]["tracking.storage_path"] = "s3://lab/studies"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    cli = [sys.executable, "-m", "prvrlab.platform.cli"]
    prefix = "studies/ablation/s3abl/"
    with s3_endpoint("lab") as s3:
        env = {**os.environ, **s3, "PRVRLAB_STAGING": str(tmp_path / "staging")}
        done = subprocess.run(cli + ["ablate", str(path)], capture_output=True, text=True, env=env, timeout=900)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert not (tmp_path / "results").exists()  # nothing of the study on local disk but the staging copy

        parents, children = study_runs(tmp_path)
        (parent,) = parents
        assert parent.info.status == "FINISHED" and len(children) == 2
        assert all(c.info.status == "FINISHED" for c in children)
        keys = [k[len(prefix):].split("/", 1)[1] for k in bucket_keys(s3, "lab", prefix) if not k.endswith("/")]
        assert {"study.json", "state.sha256", "study.log"} <= set(keys), keys
        for child in children:
            trial = child.data.tags["prvrlab.trial_id"]
            assert {f"trials/{trial}/files/{f}" for f in ("best_model.pt", "ranks_val.parquet", "config.yaml")} <= set(keys)

        out = tmp_path / "report"
        report = subprocess.run(cli + ["report", "--spec", str(path), "--out", str(out), "--bootstrap", "50"],
                                capture_output=True, text=True, env=env, timeout=600)
        assert report.returncode == 0, report.stdout[-3000:] + report.stderr[-3000:]
        text = (out / "report.md").read_text()
        assert "no_query_diverse" in text and "full" in text

        again = subprocess.run(cli + ["ablate", str(path)], capture_output=True, text=True, env=env, timeout=600)
        assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
        assert "2 already finished" in again.stdout, again.stdout[-3000:]
        assert len(study_runs(tmp_path)[1]) == 2
