"""Test setup: four CPU devices for the sharding tests, Triton's interpreter on machines without CUDA, worker
processes for ``-n auto`` (pytest-xdist), the ``gpu`` marker's skip, and fixtures shared by several files.
Helpers: ``helpers.py``."""

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


@pytest.hookimpl(wrapper=True)
def pytest_cmdline_main(config: pytest.Config):
    """Where pytest-xdist is installed (the test extras) and no GPU is visible, run the tests in worker processes,
    one per core and at most 4, each taking whole files so that a file's tests share their compiled kernels (CI's
    two cores: 9.9 minutes, 10.3 by work stealing, 14-15 in one process). Not where a GPU is (its tests share one
    device; JAX preallocates most of its memory), nor when ``-n`` is given (``-n 0``: in this process), under
    ``--pdb``, or with xdist off (``-p no:xdist``)."""
    if (not HAS_CUDA and config.pluginmanager.hasplugin("xdist") and not hasattr(config, "workerinput")
            and config.option.numprocesses is None and not config.getoption("usepdb")):
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        if cores > 1:
            config.option.numprocesses = min(cores, 4)
            if config.option.dist == "no":
                config.option.dist = "loadfile"
    return (yield)


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


@pytest.fixture(autouse=True)
def _default_gpu_model(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """Tests not marked ``gpu`` see the default model's tables (``backend.gpu_model() == ""``, the H100's) whatever
    machine runs them; a test of a model's table patches it again."""
    if request.node.get_closest_marker("gpu") is None:
        from pallas_norm import backend

        monkeypatch.setattr(backend, "gpu_model", lambda: "")
