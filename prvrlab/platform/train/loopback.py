"""Ray Train's torch process group without a TCP listener on a one-machine (loopback) cluster.

Ray Train's own ``TorchConfig`` makes rank 0 start torch's TCPStore, which listens unauthenticated on
every interface for the group's life (torch takes no bind address for it), even for one worker. On a
cluster whose node IP is a loopback address every rank is on this machine, so :class:`LoopbackTorchConfig`
meets them through a FileStore in a fresh private (0700) folder instead and tells gloo to listen on the
loopback interface (``GLOO_SOCKET_IFNAME``, unless set), as the reused worker pools do
(:mod:`prvrlab.platform.rendezvous`). On any other cluster it is Ray Train's ``TorchConfig``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import ray
from ray.train._internal.worker_group import WorkerGroup as V1WorkerGroup
from ray.train.torch.config import TorchConfig, _set_torch_distributed_env_vars, _setup_torch_process_group, _TorchBackend

from prvrlab.platform.rendezvous import is_loopback, loopback_interface, new_file_store, remove_store


def _node_ip() -> str:
    return ray.util.get_node_ip_address()


def _join(*, backend: str, world_rank: int, world_size: int, init_method: str, timeout_s: int) -> None:
    """One rank joins a file:// rendezvous, gloo on the loopback interface (read when the group is made)."""
    if not os.environ.get("GLOO_SOCKET_IFNAME"):
        interface = loopback_interface()
        if interface is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
    _setup_torch_process_group(backend=backend, world_rank=world_rank, world_size=world_size, init_method=init_method,
                               timeout_s=timeout_s)


class _LoopbackBackend(_TorchBackend):
    """``_TorchBackend`` whose ranks meet through a FileStore when every rank's node IP is loopback."""

    def __init__(self) -> None:
        super().__init__()
        self.store: str | None = None  # the rendezvous folder while it is needed

    def on_start(self, worker_group, backend_config: TorchConfig) -> None:
        hosts = worker_group.execute(_node_ip)
        if not hosts or not all(is_loopback(h) for h in hosts):
            super().on_start(worker_group, backend_config)
            return
        backend = backend_config.backend or "gloo"
        if not isinstance(worker_group, V1WorkerGroup):  # as Ray Train's own backend: LOCAL_RANK etc.
            worker_group.execute(_set_torch_distributed_env_vars)
        self.store, init_method = new_file_store()
        try:
            ray.get([
                worker_group.execute_single_async(i, _join, backend=backend, world_rank=i, world_size=len(worker_group),
                                                  init_method=init_method, timeout_s=backend_config.timeout_s)
                for i in range(len(worker_group))
            ])
        except BaseException:  # Ray Train does not call on_shutdown after a failed on_start
            self.drop_store()
            raise
        if "nccl" not in backend:  # a gloo group is done with its store once joined; NCCL reads it again
            self.drop_store()

    def on_shutdown(self, worker_group, backend_config) -> None:
        try:
            super().on_shutdown(worker_group, backend_config)
        finally:
            self.drop_store()

    def drop_store(self) -> None:
        remove_store(self.store)
        self.store = None


@dataclass
class LoopbackTorchConfig(TorchConfig):
    """``TorchConfig`` that meets ranks on a loopback cluster without a TCP listener (module docstring)."""

    @property
    def backend_cls(self):
        return _LoopbackBackend
