"""Storage by URI against a local S3 endpoint (moto): train, eval and a bad bucket, end to end."""

from __future__ import annotations

import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
import torch
import yaml

from prvrlab.platform.tracking.store import Tracker

from s3_helpers import bucket_keys, s3_endpoint
from train_helpers import small_raw


@pytest.fixture(scope="module")
def s3():
    with s3_endpoint("lab") as env:
        yield env


def _cli(args: list[str], env: dict[str, str], tmp_path, timeout: int = 400) -> subprocess.CompletedProcess:
    full = {**os.environ, **env, "PRVRLAB_STAGING": str(tmp_path / "staging"), "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "prvrlab.platform.cli", *args], capture_output=True, text=True, env=full, timeout=timeout)


def _runs(raw: dict):
    tracker = Tracker(raw["tracking"]["uri"], raw["tracking"]["experiment"])
    return tracker.client.search_runs([tracker.experiment_id])


@pytest.mark.slow
def test_train_on_ray_writes_checkpoints_and_files_to_the_bucket_then_eval_reads_them(s3, tiny_root, tmp_path):
    raw = small_raw(tiny_root, tmp_path, epochs=2)
    raw["tracking"]["storage_path"] = "s3://lab/runs"
    raw["eval"]["final_splits"] = ["val"]
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    done = _cli(["train", str(cfg)], s3, tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert not (tmp_path / "results").exists()  # nothing beside the bucket but the staging folder

    keys = [k for k in bucket_keys(s3, "lab", "runs/") if not k.endswith("/")]  # without pyarrow's folder markers
    runs = {k.split("/")[1] for k in keys if k.count("/") > 1}
    assert len(runs) == 1, keys
    (run,) = runs
    files = {k.split("/", 3)[-1] for k in keys if k.startswith(f"runs/{run}/files/")}
    assert {"best_model.pt", "ranks_val.parquet", "config.yaml", "history.json"} <= files, files
    assert "progress.json" not in files
    ray_checkpoints = {k.split("/")[2] for k in keys if k.startswith(f"runs/{run}/checkpoint_")}
    assert not [k for k in keys if k.count("/") < 2], keys  # no probe file left behind
    assert ray_checkpoints, keys  # Ray Train's recovery checkpoint (num_to_keep=1) in the bucket
    (mlflow_run,) = _runs(raw)
    assert mlflow_run.info.status == "FINISHED"

    # a fresh machine: nothing staged, the checkpoint read from the bucket and the ranks written back to it
    staged = tmp_path / "staging"
    for path in sorted(staged.rglob("*"), reverse=True):
        path.unlink() if path.is_file() else path.rmdir()
    evaluated = _cli(["eval", f"s3://lab/runs/{run}/files/best_model.pt", "--split", "val", "--ranks", "s3://lab/eval/ranks.parquet"], s3, tmp_path)
    assert evaluated.returncode == 0, evaluated.stdout[-3000:] + evaluated.stderr[-3000:]
    assert "model of epoch" in evaluated.stdout and "SumR" in evaluated.stdout
    assert "eval/ranks.parquet" in bucket_keys(s3, "lab", "eval/")
    # the same model on the same split: the ranks training wrote to the bucket, query by query
    local = _download(s3, "lab", f"runs/{run}/files/ranks_val.parquet", tmp_path / "trained.parquet")
    again = _download(s3, "lab", "eval/ranks.parquet", tmp_path / "again.parquet")
    trained, evaluated_ranks = pq.read_table(local).to_pandas(), pq.read_table(again).to_pandas()
    assert len(trained) > 0 and trained.equals(evaluated_ranks)
    blob = torch.load(staged / "s3" / "lab" / "runs" / run / "files" / "best_model.pt", weights_only=True)
    assert f"model of epoch {blob['epoch']}" in evaluated.stdout


def _download(env: dict[str, str], bucket: str, key: str, target):
    import boto3

    client = boto3.client(
        "s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name=env["AWS_DEFAULT_REGION"],
    )
    client.download_file(bucket, key, str(target))
    return target


def test_missing_bucket_is_one_line_naming_the_key_exit_2_nothing_recorded(s3, tiny_root, tmp_path):
    raw = small_raw(tiny_root, tmp_path, epochs=1)
    raw["tracking"]["storage_path"] = "s3://no-such-bucket/runs"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    done = _cli(["train", str(cfg), "--no-ray"], s3, tmp_path, timeout=120)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    (line,) = [ln for ln in done.stderr.splitlines() if "tracking.storage_path" in ln]
    assert "s3://no-such-bucket/runs" in line and "bucket does not exist" in line.lower(), done.stderr
    assert _runs(raw) == []
