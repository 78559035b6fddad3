"""Ray Train's worker groups (``prvrlab train`` on Ray, a search's worker group per trial) meet without a
TCP listener on a loopback cluster: a FileStore in a private temp folder and gloo on the loopback
interface, so no rank socket listens beyond 127.0.0.1. Elsewhere Ray Train's own TCP rendezvous runs."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from prvrlab.platform import rendezvous
from prvrlab.platform.train import loopback
from socket_helpers import listening, on_loopback


class _FakeGroup:
    """A worker group of ``hosts`` whose calls run in this process (``_join`` recorded, not run)."""

    def __init__(self, hosts):
        self.hosts = hosts
        self.joins: list[dict] = []
        self.ran: list[str] = []

    def __len__(self):
        return len(self.hosts)

    def execute(self, fn, *args, **kwargs):
        self.ran.append(fn.__name__)
        return list(self.hosts) if fn is loopback._node_ip else [None] * len(self.hosts)

    def execute_single_async(self, i, fn, **kwargs):
        assert fn is loopback._join
        folder = rendezvous.store_folder(kwargs["init_method"])
        self.joins.append({**kwargs, "folder_mode": stat.S_IMODE(os.stat(folder).st_mode), "files": os.listdir(folder)})
        return i


@pytest.fixture
def fake_ray(monkeypatch):
    monkeypatch.setattr(loopback.ray, "get", lambda refs: refs)
    tcp = []
    monkeypatch.setattr(loopback._TorchBackend, "on_start", lambda self, group, config: tcp.append(group))
    return tcp


def test_a_loopback_group_meets_through_a_private_file_store(fake_ray):
    backend, group = loopback._LoopbackBackend(), _FakeGroup(["127.0.0.1", "127.0.0.1"])
    backend.on_start(group, loopback.LoopbackTorchConfig(backend="gloo", timeout_s=60))
    assert fake_ray == []  # not Ray Train's TCP rendezvous
    assert [j["world_rank"] for j in group.joins] == [0, 1] and {j["world_size"] for j in group.joins} == {2}
    (url,) = {j["init_method"] for j in group.joins}
    folder = rendezvous.store_folder(url)
    assert url == f"file://{folder}/store" and os.path.basename(folder).startswith(rendezvous.STORE_PREFIX)
    assert {j["folder_mode"] for j in group.joins} == {0o700} and all(j["files"] == [] for j in group.joins)
    assert {j["backend"] for j in group.joins} == {"gloo"} and {j["timeout_s"] for j in group.joins} == {60}
    assert "_set_torch_distributed_env_vars" in group.ran  # LOCAL_RANK and the rest, as Ray Train sets them
    assert not os.path.exists(folder) and backend.store is None  # a gloo group is done with its store


def test_an_nccl_group_keeps_its_store_until_shutdown(fake_ray, monkeypatch):
    monkeypatch.setattr(loopback._TorchBackend, "on_shutdown", lambda self, group, config: None)
    backend, group = loopback._LoopbackBackend(), _FakeGroup(["127.0.0.1"])
    config = loopback.LoopbackTorchConfig(backend="cpu:gloo,cuda:nccl")
    backend.on_start(group, config)
    folder = rendezvous.store_folder(group.joins[0]["init_method"])
    assert os.path.isdir(folder) and backend.store == folder
    backend.on_shutdown(group, config)
    assert not os.path.exists(folder) and backend.store is None


@pytest.mark.parametrize("backend", ["gloo", "cpu:gloo,cuda:nccl"])
def test_a_group_that_fails_to_join_leaves_no_store(fake_ray, monkeypatch, backend):
    """Ray Train does not call on_shutdown after a failed on_start: the folder goes with the failure."""
    def fail(refs):
        raise RuntimeError("a rank could not join")

    monkeypatch.setattr(loopback.ray, "get", fail)
    backend_, group = loopback._LoopbackBackend(), _FakeGroup(["127.0.0.1", "127.0.0.1"])
    with pytest.raises(RuntimeError, match="could not join"):
        backend_.on_start(group, loopback.LoopbackTorchConfig(backend=backend))
    folder = rendezvous.store_folder(group.joins[0]["init_method"])
    assert not os.path.exists(folder) and backend_.store is None


def test_any_rank_off_loopback_keeps_ray_trains_rendezvous(fake_ray):
    group = _FakeGroup(["127.0.0.1", "10.0.0.5"])
    loopback._LoopbackBackend().on_start(group, loopback.LoopbackTorchConfig(backend="gloo"))
    assert fake_ray == [group] and group.joins == []


def _rank_probe(config: dict) -> None:
    """A train function: all-reduce once, then write this rank's listening sockets and gloo interface."""
    import torch
    import torch.distributed as dist

    one = torch.ones(1)
    dist.all_reduce(one)
    out = {"sum": one.item(), "ifname": os.environ.get("GLOO_SOCKET_IFNAME"), "listening": listening(os.getpid())}
    Path(config["out"], f"rank{dist.get_rank()}.json").write_text(json.dumps(out))


@pytest.mark.slow
def test_a_ray_train_group_on_the_local_cluster_listens_on_loopback_only(tmp_path, monkeypatch):
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from prvrlab.platform.runtime import ensure_ray

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("PRVRLAB_RAY_BIND", raising=False)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    import sys

    from ray import cloudpickle

    for module in (sys.modules[__name__], sys.modules[listening.__module__]):  # test modules the workers cannot import
        cloudpickle.register_pickle_by_value(module)
    ensure_ray()
    try:
        before = set(p.name for p in Path(os.environ.get("TMPDIR", "/tmp")).glob(f"{rendezvous.STORE_PREFIX}*"))
        trainer = TorchTrainer(
            _rank_probe,
            train_loop_config={"out": str(tmp_path)},
            torch_config=loopback.LoopbackTorchConfig(backend="gloo"),
            scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
            run_config=RunConfig(name="rdv", storage_path=str(tmp_path / "results")),
        )
        trainer.fit()
    finally:
        ray.shutdown()
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["sum"] for r in ranks] == [2.0, 2.0]
    assert [r["ifname"] for r in ranks] == [rendezvous.loopback_interface()] * 2
    assert all(r["listening"] for r in ranks)  # gloo listens in every rank
    exposed = [s for r in ranks for s in r["listening"] if not on_loopback(s[0])]
    assert not exposed, f"rank sockets listening beyond loopback: {exposed}"
    after = set(p.name for p in Path(os.environ.get("TMPDIR", "/tmp")).glob(f"{rendezvous.STORE_PREFIX}*"))
    assert after <= before  # the rendezvous folder is gone


def test_a_training_run_and_a_search_trial_build_their_trainers_with_it():
    from prvrlab.platform.search import study
    from prvrlab.platform.train import driver

    for module in (driver, study):  # every TorchTrainer the platform builds
        source = Path(module.__file__).read_text()
        assert source.count("torch_config=LoopbackTorchConfig(backend=process_group_backend(") == 1
        assert source.count("torch_config=") == 1
