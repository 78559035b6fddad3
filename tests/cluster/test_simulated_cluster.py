"""The simulated-cluster helper leaves no Ray process behind when the cluster fails to come up after its
head node started (as it did on a machine without Ray's default temp folder)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import cluster_helpers
from cluster_helpers import simulated_cluster

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]


def processes_naming(fragment: str) -> list[str]:
    out = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if fragment in text:
            out.append(text)
    return out


def test_a_cluster_failing_after_its_head_started_leaves_no_process(monkeypatch):
    import ray._private.utils

    folders: list[Path] = []
    real = cluster_helpers.kill_processes_under

    def record(folder: Path) -> None:
        folders.append(folder)
        assert processes_naming(str(folder)), "the head node had started: its processes are running"
        real(folder)

    def fail(*args, **kwargs):
        raise FileNotFoundError("simulated: no folder for the address file")

    monkeypatch.setattr(cluster_helpers, "kill_processes_under", record)
    monkeypatch.setattr(ray._private.utils, "write_ray_address", fail)  # Cluster calls it after the head starts
    with pytest.raises(FileNotFoundError, match="simulated"):
        with simulated_cluster(head_cpus=1):
            pass
    assert len(folders) == 1
    assert not [p for p in processes_naming(str(folders[0])) if "pytest" not in p]
    assert not folders[0].exists()
