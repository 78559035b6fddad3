"""The ranks' torch.distributed backend: gloo on CPUs; on GPUs NCCL for CUDA tensors and gloo for CPU ones.
The CPU tensors name their device: under ``PRVRLAB_TEST_DEVICE=cuda`` the default device is the GPU."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import BackendConfig

from prvrlab.platform.train.session import process_group_backend


def test_cpu_ranks_use_gloo():
    assert process_group_backend(False) == "gloo"


def test_gpu_ranks_map_cuda_tensors_to_nccl_and_cpu_tensors_to_gloo():
    """torch's own parser reads the string as one backend per device type."""
    assert BackendConfig(process_group_backend(True)).get_device_backend_map() == {"cpu": "gloo", "cuda": "nccl"}


def test_ray_train_sets_its_nccl_environment_for_the_gpu_backend():
    _is_backend_nccl = pytest.importorskip("ray.train.torch.config")._is_backend_nccl

    assert _is_backend_nccl(process_group_backend(True))
    assert not _is_backend_nccl(process_group_backend(False))


def _one_rank_group(backend: str, tmp_path) -> None:
    dist.init_process_group(backend, init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)


@pytest.mark.skipif(not (torch.cuda.is_available() and dist.is_nccl_available()), reason="needs CUDA and NCCL")
def test_gpu_backend_reduces_cpu_and_cuda_tensors_and_objects(tmp_path):
    """What the training loop exchanges on GPU ranks: CPU float64 sums (epoch means), CUDA tensors, objects."""
    _one_rank_group(process_group_backend(True), tmp_path)
    try:
        sums = torch.tensor([1.5, 2.0], dtype=torch.float64, device="cpu")  # (2,) as MetricSums.means
        dist.all_reduce(sums)
        assert sums.tolist() == [1.5, 2.0]
        flag = torch.ones(1, device="cuda")
        dist.all_reduce(flag)
        assert flag.item() == 1.0
        gathered = [None]
        dist.all_gather_object(gathered, {"ids": ["v1", "v2"]})
        assert gathered == [{"ids": ["v1", "v2"]}]
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not (torch.cuda.is_available() and dist.is_nccl_available()), reason="needs CUDA and NCCL")
def test_nccl_alone_refuses_cpu_tensors(tmp_path):
    """Why the GPU backend names gloo for the CPU: NCCL by itself has no CPU backend."""
    _one_rank_group("nccl", tmp_path)
    try:
        with pytest.raises(RuntimeError):
            dist.all_reduce(torch.ones(2, dtype=torch.float64, device="cpu"))
    finally:
        dist.destroy_process_group()
