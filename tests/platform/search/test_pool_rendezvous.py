"""Where a reused worker pool's ranks meet: on a loopback (one-machine) cluster through a FileStore in a
private temp folder, with gloo on the loopback interface, so no rank listens beyond 127.0.0.1; the folder
goes once a gloo group has joined (an NCCL one's with the pool).  A non-loopback node keeps the tcp://
rendezvous (multi-node)."""

from __future__ import annotations

import os
import socket
import stat
from types import SimpleNamespace

import pytest

from prvrlab.platform.search import workers
from socket_helpers import listening as listening_of, on_loopback


def test_loopback_addresses_and_interface():
    assert all(workers.is_loopback(h) for h in ("127.0.0.1", "127.0.1.1", "::1", "localhost"))
    assert not any(workers.is_loopback(h) for h in ("10.0.0.5", "0.0.0.0", "192.168.1.2", "node-1"))
    __import__("ray")  # puts Ray's psutil (ray/thirdparty_files) on the path

    import psutil

    name = workers.loopback_interface()
    assert name is not None
    assert any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in psutil.net_if_addrs()[name])
    assert workers.store_folder("file:///tmp/prvrlab-pg-x/store") == "/tmp/prvrlab-pg-x"
    assert workers.store_folder("tcp://10.0.0.5:1234") is None


def test_rank0_picks_a_private_file_store_on_loopback_and_tcp_elsewhere(monkeypatch):
    import ray

    rank0 = SimpleNamespace(store=None)
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.0.0.5")
    url = workers.PoolWorker.rendezvous(rank0)
    assert url.startswith("tcp://10.0.0.5:") and int(url.rsplit(":", 1)[1]) > 0 and rank0.store is None
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    url = workers.PoolWorker.rendezvous(rank0)
    try:
        folder = workers.store_folder(url)
        assert url == f"file://{rank0.store}/store" and folder == rank0.store
        assert os.path.basename(folder).startswith(workers.STORE_PREFIX)
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700 and os.listdir(folder) == []  # no stale store file
    finally:
        workers.PoolWorker.drop_store(rank0)
    assert not os.path.exists(folder) and rank0.store is None


class _Method:
    def __init__(self, fn):
        self.remote = fn


class _FakeRank:
    def __init__(self, init_method: str):
        self.rendezvous = _Method(lambda: init_method)
        self.join = _Method(lambda **kw: kw)


def _fake_pool(monkeypatch, folder, *, gpus: float, joins_fail: bool = False):
    import ray

    def get(ref):
        if isinstance(ref, list) and joins_fail:
            raise RuntimeError("a rank died while joining")
        return [os.getpid()] * len(ref) if isinstance(ref, list) else ref

    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart=True: None)
    folder.mkdir(mode=0o700)
    return workers.WorkerPool(workers=2, cpus=1.0, gpus=gpus, name="fake", actors=[_FakeRank(f"file://{folder}/store")] * 2)


def test_a_pool_whose_join_fails_leaves_no_rendezvous_folder(monkeypatch, tmp_path):
    pool = _fake_pool(monkeypatch, tmp_path / "prvrlab-pg-fake", gpus=0.0, joins_fail=True)
    with pytest.raises(RuntimeError, match="while joining"):
        pool.ready()
    assert not (tmp_path / "prvrlab-pg-fake").exists() and pool.store is None


def test_an_nccl_pool_keeps_its_file_store_until_it_is_shut_down(monkeypatch, tmp_path):
    """NCCL reads the store again at a GPU rank's first collective; a gloo group is done with it once joined."""
    nccl = _fake_pool(monkeypatch, tmp_path / "nccl", gpus=1.0)
    nccl.ready()
    assert (tmp_path / "nccl").is_dir() and nccl.store == str(tmp_path / "nccl")
    nccl.shutdown()
    assert not (tmp_path / "nccl").exists() and nccl.store is None
    gloo = _fake_pool(monkeypatch, tmp_path / "gloo", gpus=0.0)
    gloo.ready()
    assert not (tmp_path / "gloo").exists() and gloo.store is None


@pytest.fixture(scope="module")
def ray_shutdown():
    yield
    import ray

    ray.shutdown()


@pytest.mark.slow
def test_a_loopback_pools_ranks_listen_on_loopback_only_and_leave_no_store(ray_shutdown, monkeypatch):
    import ray

    from prvrlab.platform.runtime import ensure_ray

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("PRVRLAB_RAY_BIND", raising=False)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)  # the ranks inherit the cluster's environment
    ensure_ray()
    pool = workers.WorkerPool(workers=2, cpus=0.5, gpus=0.0, name=f"prvrlab-test-rdv-{os.getpid()}")
    folder = None
    try:
        pool.ready()
        listening = {pid: listening_of(pid) for pid in pool.pids}
        assert all(listening.values()), listening  # gloo listens in every rank
        exposed = {pid: [s for s in socks if not on_loopback(s[0])] for pid, socks in listening.items()}
        assert not any(exposed.values()), f"rank sockets listening beyond loopback: {exposed}"
        # gloo listens where its hostname resolves unless told: the loopback interface, in every rank
        ifnames = ray.get([a.__ray_call__.remote(lambda _: os.environ.get("GLOO_SOCKET_IFNAME")) for a in pool.actors])
        assert ifnames == [workers.loopback_interface()] * 2

        folder = workers.store_folder(pool.init_method)
        assert folder is not None and os.path.basename(folder).startswith(workers.STORE_PREFIX)
        assert not os.path.exists(folder) and pool.store is None  # a gloo group: removed once every rank joined

        def all_reduce(_actor) -> float:
            import torch
            import torch.distributed as dist

            one = torch.ones(1)
            dist.all_reduce(one)
            return one.item()

        assert ray.get([a.__ray_call__.remote(all_reduce) for a in pool.actors]) == [2.0, 2.0]  # works without its store
    finally:
        pool.shutdown()
    assert folder is not None and not os.path.exists(folder)
