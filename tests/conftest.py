"""Suite-wide fixtures: single-threaded, seeded tests (the CI machine has 2 cores), the tiny synthetic
collection, and the config helpers of tests/platform (train_helpers, search_helpers) on the path.

``PRVRLAB_TEST_DEVICE=cuda`` runs the tests' tensors on the GPU (tests/device_under_test.py); the session
refuses to start when that device is not there, so a GPU run never passes silently on the CPU."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "platform"))

from device_under_test import DEVICE  # noqa: E402  (tests/ is on the path: this file's folder)


def pytest_configure(config):
    if DEVICE.type == "cpu":
        return
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        pytest.exit(f"PRVRLAB_TEST_DEVICE={DEVICE} but torch sees no CUDA device", returncode=2)
    torch.set_default_device(DEVICE)


def pytest_report_header(config):
    return f"prvrlab test device: {DEVICE} (PRVRLAB_TEST_DEVICE)"


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> Path:
    """The ``tiny`` synthetic collection, written once per test session."""
    from prvrlab.data.synth import synthesize

    root = tmp_path_factory.mktemp("synth_tiny")
    synthesize(root, preset="tiny", seed=0, progress=False)
    return root


@pytest.fixture(autouse=True)
def _single_thread_seeded():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
    torch.set_num_threads(threads)


REPO = Path(__file__).resolve().parents[1]
DEBRIS = ("mlruns", "results", "mlflow.db")


@pytest.fixture(autouse=True)
def _stores_in_tmp(tmp_path, monkeypatch):
    """Default MLflow store and results of every test in its tmp folder, never in the repository."""
    monkeypatch.setenv("PRVRLAB_HOME", str(tmp_path))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")


@pytest.fixture(autouse=True, scope="session")
def _cache_in_tmp(tmp_path_factory):
    """The per-user cache (data indexes, feature checks) in the session's tmp folder, not the user's home;
    its ``native`` kernels stay the user's where that folder can be made, so the suite does not rebuild them
    (nor do Ray's workers)."""
    import os

    from prvrlab.cache import cache_root

    shared = cache_root() / "native"
    cache = tmp_path_factory.mktemp("cache")
    try:
        shared.mkdir(parents=True, exist_ok=True)
        (cache / "native").symlink_to(shared, target_is_directory=True)
    except OSError:  # a home that cannot be written: the kernels are built in the session's folder
        pass
    before = os.environ.get("PRVRLAB_CACHE_DIR")
    os.environ["PRVRLAB_CACHE_DIR"] = str(cache)
    yield cache
    if before is None:
        os.environ.pop("PRVRLAB_CACHE_DIR", None)
    else:
        os.environ["PRVRLAB_CACHE_DIR"] = before


@pytest.fixture(autouse=True, scope="session")
def _no_debris_in_repository():
    """Fail the session when it created mlruns/, results/ or mlflow.db in the repository."""
    before = {name for name in DEBRIS if (REPO / name).exists()}
    yield
    created = sorted(name for name in DEBRIS if (REPO / name).exists() and name not in before)
    assert not created, f"tests wrote into the repository: {created}"
