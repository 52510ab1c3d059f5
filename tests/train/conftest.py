"""One torch thread per test process: `make test` runs two pytest workers on two cores, and a
second OpenMP thread spinning on a busy core slows small models down by 10-50x."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    torch.set_num_threads(1)
