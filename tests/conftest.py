"""Shared test configuration: `gpu` tests are skipped on machines without CUDA."""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `make test-gpu` on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
