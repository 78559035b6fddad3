"""A search on a 2-node cluster with its study on a local S3 endpoint (moto): trials on both nodes,
checkpoints, per-query ranks and study state in the bucket, nothing of the study on local disk."""

from __future__ import annotations

import pytest
import yaml

from prvrlab.platform.search.spec import load_search_spec
from prvrlab.platform.search.tuning import search

from cluster_helpers import simulated_cluster
from s3_helpers import bucket_keys, s3_client, s3_endpoint
from search_helpers import study_runs, tiny_spec

pytestmark = pytest.mark.slow

TRIALS = 2


def test_a_two_node_search_keeps_its_study_in_the_bucket(tiny_root, tmp_path, monkeypatch):
    path = tiny_spec(
        tmp_path, tiny_root, name="s3cluster", budget={"trials": TRIALS}, concurrency=2,
        resources={"workers_per_trial": 2, "cpus_per_worker": 1, "placement_timeout_s": 120},
    )  # fmt: skip
    raw = yaml.safe_load(path.read_text())
    raw["overrides"]["tracking.storage_path"] = "s3://lab/studies"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    prefix = "studies/search/s3cluster/"
    with s3_endpoint("lab") as s3:
        for key, value in {**s3, "PRVRLAB_STAGING": str(tmp_path / "staging")}.items():
            monkeypatch.setenv(key, value)  # before the nodes start: their workers inherit it
        with simulated_cluster(head_cpus=3) as sim:
            worker = sim.add_node(num_cpus=3)
            result = search(load_search_spec(path), echo=print)
            head = sim.head_id
        keys = [k for k in bucket_keys(s3, "lab", prefix) if not k.endswith("/")]
        client = s3_client(s3)
        nodes = set()
        for key in keys:
            if key.endswith("/nodes.txt"):
                text = client.get_object(Bucket="lab", Key=key)["Body"].read().decode()
                nodes |= {line.split()[1] for line in text.splitlines() if line.strip()}
    assert result.counts["finished"] == TRIALS, result.counts
    assert nodes == {head, worker.node_id}  # the two trials' ranks ran on both nodes
    assert not (tmp_path / "results").exists()
    names = [k[len(prefix):].split("/", 1)[1] for k in keys]
    assert {"study.json", "state.sha256", "best_config.yaml"} <= set(names), names
    _, children = study_runs(tmp_path)
    assert len(children) == TRIALS and all(c.info.status == "FINISHED" for c in children)
    for child in children:
        trial = child.data.tags["prvrlab.trial_id"]
        assert {f"trials/{trial}/files/{f}" for f in ("best_model.pt", "ranks_val.parquet", "nodes.txt")} <= set(names)
    assert any(n.startswith("train/") for n in names), names  # Ray Train's checkpoints of the worker groups
