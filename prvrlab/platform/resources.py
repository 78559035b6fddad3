"""Whether a DDP request fits a Ray cluster: checked before any run is recorded (``prvrlab train``, studies)."""

from __future__ import annotations

import os


def shortfall(
    workers: int,
    cpus_per_worker: float | None,
    gpus_per_worker: float,
    cluster: dict[str, float],
    *,
    workers_key: str,
    cpus_key: str,
    gpus_setting: str,
    reserved: float = 0.0,
) -> str | None:
    """Why ``workers`` DDP ranks cannot run on ``cluster`` (its ``CPU`` and ``GPU`` totals), or None.

    Each rank is a process running torch, so a job gets at least one CPU per rank;
    ``cpus_per_worker`` (None: a share of the cluster) and ``reserved`` (CPUs held
    besides the ranks) must fit too. Messages name the keys that set the request.
    """
    cpus, gpus = float(cluster.get("CPU", 0)), float(cluster.get("GPU", 0))
    if gpus_per_worker > 0 and gpus_per_worker * workers > gpus:
        return (
            f"{gpus_setting} needs {gpus_per_worker:g} GPU per worker, {gpus_per_worker * workers:g} with "
            f"{workers_key}={workers}; the cluster has {gpus:g} GPUs"
        )
    if workers > cpus:
        return (
            f"{workers_key}={workers} needs at least {workers} CPUs (each worker is a process running torch); "
            f"the cluster has {cpus:g} CPUs"
        )
    if cpus_per_worker is not None and cpus_per_worker * workers + reserved > cpus:
        return (
            f"{cpus_key}={cpus_per_worker:g} x {workers_key}={workers} needs {cpus_per_worker * workers + reserved:g} CPUs; "
            f"the cluster has {cpus:g} CPUs"
        )
    return None


def local_cluster() -> dict[str, float]:
    """What :func:`prvrlab.platform.runtime.ensure_ray` starts without ``$RAY_ADDRESS``: this machine's CPUs and CUDA devices."""
    import torch

    return {"CPU": float(os.cpu_count() or 1), "GPU": float(torch.cuda.device_count())}
