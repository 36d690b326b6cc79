"""``torch_bridge`` on two GPUs (device, ``nvidia-h200-x2``; skipped with fewer): tensors on either GPU from one
process, whatever GPU is current, and DDP/FSDP2 through ``examples/multi_gpu_torch.py`` under torchrun."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import contextlib

import pytest
import torch

from torch_bridge import custom_ops, jax_device

from helpers import torch_inputs, torch_results

pytestmark = pytest.mark.gpu
ROOT = pathlib.Path(__file__).resolve().parents[1]
BACKENDS = ["pallas", "pallas_launch", "triton"]


def two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")


@pytest.mark.parametrize("backend", BACKENDS)
def test_tensors_on_the_other_gpu_leave_the_current_device_alone(backend):
    two_gpus()
    for current, data in ((0, 1), (1, 0), (1, 1)):
        x, w, dy = torch_inputs((64, 1024), torch.bfloat16, 0.0, seed=data, device=f"cuda:{data}")
        torch.cuda.set_device(data)
        alone = [t.clone() for t in torch_results(x, w, dy, backend=backend)]
        torch.cuda.set_device(current)
        got = torch_results(x, w, dy, backend=backend)
        torch.cuda.synchronize(data)
        assert torch.cuda.current_device() == current
        assert all(t.device.index == data and torch.equal(t, a) for t, a in zip(got, alone))
    torch.cuda.set_device(0)


def test_a_bridge_without_the_device_guard_is_caught(monkeypatch):
    """Deliberately broken: no switch to x's GPU, so torch refuses the DLPack export from the other GPU."""
    two_gpus()
    monkeypatch.setattr(custom_ops, "current_device_of", lambda t: contextlib.nullcontext())
    x, w, dy = torch_inputs((64, 1024), torch.bfloat16, 0.0, device="cuda:1")
    torch.cuda.set_device(0)
    with pytest.raises(BufferError, match="different CUDA device"):
        torch_results(x, w, dy, backend="pallas")
    assert jax_device.current_device_of is not custom_ops.current_device_of


@pytest.mark.parametrize("backend", BACKENDS)
def test_ddp_and_fsdp2_on_two_gpus(backend):
    two_gpus()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               NCCL_NVLS_ENABLE="0")  # NVLink multicast off (device README)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           str(ROOT / "examples" / "multi_gpu_torch.py"), "--backend", backend],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0 and "all checks passed" in proc.stdout, proc.stdout + proc.stderr[-4000:]
    assert proc.stdout.count(" ok  ") == 2 * 4
