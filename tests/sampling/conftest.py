import pytest
import torch


@pytest.fixture(autouse=True)
def _single_thread():
    """The sampler tests push tiny tensors; intra-op threads only add contention on a small, busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
