"""One torch thread for these tests: tiny models are dominated by thread start-up and, on a busy 2-core
machine, by oversubscription (10x slower with 2 threads when other processes compete)."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
