import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic_torch():
    """Every test starts from the same global RNG state and torch's default dtype."""
    torch.manual_seed(0)
    yield
    torch.set_default_dtype(torch.float32)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
