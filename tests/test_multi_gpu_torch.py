"""``torch_bridge`` under DDP and FSDP2 on two GPUs: runs ``examples/multi_gpu_torch.py`` with torchrun (device,
``nvidia-h200-x2``); skipped with fewer than two GPUs."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu
ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("backend", ["pallas", "pallas_launch", "triton"])
def test_ddp_and_fsdp2_on_two_gpus(backend):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               NCCL_NVLS_ENABLE="0")  # NVLink multicast off (device README)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           str(ROOT / "examples" / "multi_gpu_torch.py"), "--backend", backend],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0 and "all checks passed" in proc.stdout, proc.stdout + proc.stderr[-4000:]
    assert proc.stdout.count(" ok  ") == 2 * 4
