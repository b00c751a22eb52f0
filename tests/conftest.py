"""Test configuration: a fixed torch seed per test, CUDA-marked tests skipped on CPU machines, a temporary
MXTRAIN_CACHE, and on machines without a GPU Triton's interpreter for every test module (Triton reads
TRITON_INTERPRET when a kernel is defined, so it must be set before any module imports mxtrain.kernels)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# records of checked data shards go to a temporary folder, not the user's cache
if "MXTRAIN_CACHE" not in os.environ:
    import tempfile
    os.environ["MXTRAIN_CACHE"] = tempfile.mkdtemp(prefix="mxtrain-test-cache-")


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
