"""Test setup: four CPU devices for the sharding tests, Triton's interpreter on machines without CUDA, the
``gpu`` marker's skip, and fixtures shared by several files. Helpers: ``helpers.py``."""

from __future__ import annotations

import os

import pytest
import torch

# Four CPU devices for tests/test_sharding.py: XLA reads this when JAX first initialises its CPU backend.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

pytest.register_assert_rewrite("helpers")  # its asserts report values, as the tests' own do

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Must be set before triton is imported anywhere: CPU tests run the real Triton kernels interpreted.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _release_cached_gpu_memory(request: pytest.FixtureRequest):
    """After each ``gpu`` test, hand torch's cached blocks back, so JAX (which allocates outside torch's cache)
    finds the memory the next large case needs."""
    yield
    if HAS_CUDA and request.node.get_closest_marker("gpu") is not None:
        torch.cuda.empty_cache()
