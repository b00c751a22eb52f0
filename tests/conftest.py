"""Test configuration: a fixed torch seed per test, and CUDA-marked tests skipped on CPU machines."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed_torch():
    torch.manual_seed(0)
    yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
