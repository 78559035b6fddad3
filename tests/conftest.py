"""Suite-wide fixtures: single-threaded, seeded tests (the CI machine has 2 cores)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_thread_seeded():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
    torch.set_num_threads(threads)
