"""The muP tests train tiny models (hidden 32-256), where a second intra-op thread buys nothing and, beside the
other pytest-xdist worker on a 2-core machine, costs time: one thread each, restored afterwards."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
