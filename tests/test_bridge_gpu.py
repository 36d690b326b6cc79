"""The bridge on a GPU: the DLPack route gives JAX's bits at LLM sizes, the launch route is as accurate as the
reference kernel, no backend races torch's stream, device and host memory stay flat over 10k calls, and the launch route falls back
to DLPack when a lowered module is not a kernel chain."""

from __future__ import annotations

import gc
import os

import jax
import pytest
import torch

from torch_bridge import launch_route, pallas_backends, rms_norm

from helpers import assert_same_bits, check_case, jax_results, torch_inputs, torch_results

pytestmark = pytest.mark.gpu


SHAPES = [
        ((8, 4096), torch.bfloat16, "llama", 0.0, None),
        ((32768, 4096), torch.bfloat16, "llama", 0.0, None),
        ((4096, 4096), torch.bfloat16, "gemma", 1.0, torch.float32),
        ((65536, 2304), torch.float16, "none", 0.0, None),
        ((64, 20000), torch.float32, "gemma", 1.0, None),
        ((1024, 262144), torch.bfloat16, "llama", 0.0, None),
        ((3, 65537), torch.bfloat16, "none", 0.0, None),
]


@pytest.mark.parametrize("shape,dtype,casting,offset,weight_dtype", SHAPES, ids=str)
def test_dlpack_route_bit_identical_to_jax_on_gpu(shape, dtype, casting, offset, weight_dtype):
    x, w, dy = torch_inputs(shape, dtype, offset, weight_dtype=weight_dtype, seed=4)
    kw = dict(eps=1e-6, offset=offset, casting=casting)
    assert_same_bits(torch_results(x, w, dy, backend="pallas", **kw), jax_results(x, w, dy, **kw))


@pytest.mark.parametrize("shape,dtype,casting,offset,weight_dtype", SHAPES, ids=str)
def test_launch_route_accuracy(shape, dtype, casting, offset, weight_dtype):
    """Torch's Triton compiles the Pallas IR with another reduction order than XLA's Triton, so the launch route
    is held to the reference kernel's rule (vs float64, and the naive formula's rounding points), not to bits.
    Under "none" casting rstd itself is rounded to x's dtype, so a last-bit change in the float32 rstd may flip
    that rounding and move a whole row by one ulp of rstd: there only the float64 accuracy bound applies."""
    check_case(shape, dtype, casting, offset, weight_dtype=weight_dtype, seed=4, backend="pallas_launch",
               rounding_points=casting != "none")


def race_free(step, reps: int = 4, sleep_cycles: int = 40_000_000) -> bool:
    """Run ``step(x, w, dy) -> tensors`` on a side stream right after a slow producer (``sleep_cycles`` GPU
    cycles, 40M ≈ 20 ms) that writes x and dy (their buffers hold NaN until then), consume the results at once
    on that stream, and compare with a synchronous run. Fresh data each rep (seeds cycle through 16 sets), so a
    stale buffer from the previous rep cannot pass by luck."""
    side = torch.cuda.Stream()
    ok = True
    for rep in range(reps):
        x_src, w, dy_src = torch_inputs((8, 4096), torch.bfloat16, 0.0, seed=10 + rep % 16)
        expected = [t.clone() for t in step(x_src, w, dy_src)]
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            x = torch.full_like(x_src, float("nan"))
            dy = torch.full_like(dy_src, float("nan"))
            torch.cuda._sleep(sleep_cycles)
            x.copy_(x_src), dy.copy_(dy_src)
            got = [t.clone() for t in step(x, w, dy)]
        torch.cuda.synchronize()
        ok &= all(torch.equal(a, b) for a, b in zip(got, expected))
    return ok


def _autograd_step(backend):
    def step(x, w, dy):
        x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
        y = rms_norm(x, w, backend=backend)
        return (y, *torch.autograd.grad(y, (x, w), dy))
    return step


def _launch_on_own_stream(x, w, dy):
    """Deliberately broken bridge: launches on a stream of its own, not waiting for torch's current one."""
    launcher = launch_route.forward_launcher(*x.shape, x.dtype, w.dtype, 1e-6, 0.0, "llama", x.device.index)
    return launcher(x, w, stream=torch.cuda.Stream().cuda_stream)[:1]


@pytest.mark.parametrize("backend", ["pallas_launch", "pallas_dlpack", "triton"])
def test_no_race_with_torch_streams(backend):
    assert race_free(_autograd_step(backend))
    assert race_free(_autograd_step(backend), reps=1000, sleep_cycles=2_000_000)  # 1000 × a ~1 ms producer


def test_race_check_catches_a_bridge_ignoring_torch_stream():
    assert not race_free(_launch_on_own_stream)


def _jax_bytes_in_use() -> int:
    return jax.devices("gpu")[0].memory_stats()["bytes_in_use"]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_growth(step, calls: int) -> tuple[int, int, int]:
    """(torch, JAX) device bytes in use and host RSS after ``calls`` calls of ``step`` minus before (after a
    warm-up, garbage collected)."""
    for _ in range(100):
        step()
    torch.cuda.synchronize(), gc.collect()
    before = torch.cuda.memory_allocated(), _jax_bytes_in_use(), _rss_bytes()
    for _ in range(calls):
        step()
    torch.cuda.synchronize(), gc.collect()
    after = torch.cuda.memory_allocated(), _jax_bytes_in_use(), _rss_bytes()
    return tuple(a - b for a, b in zip(after, before))


@pytest.mark.parametrize("backend", ["pallas_launch", "pallas_dlpack", "triton"])
def test_memory_flat_over_10k_calls(backend):
    """Device memory (torch's allocator and JAX's) unchanged and host RSS within 16 MiB over 10k fwd+bwd calls."""
    x, w, dy = torch_inputs((8, 4096), torch.bfloat16, 0.0)
    x.requires_grad_(), w.requires_grad_()

    def step():
        rms_norm(x, w, backend=backend).backward(dy)
        x.grad = w.grad = None

    torch_growth, jax_growth, host_growth = memory_growth(step, 10_000)
    assert (torch_growth, jax_growth) == (0, 0)
    assert host_growth < 16 * 2**20, f"host RSS grew {host_growth / 2**20:.1f} MiB over 10k calls"
    kept = []
    assert sum(memory_growth(lambda: kept.append(rms_norm(x, w, backend=backend)), 100)[:2]) > 0  # a leak shows


def test_launch_route_falls_back_to_dlpack(monkeypatch):
    x, w, dy = torch_inputs((5, 256), torch.bfloat16, 1.0, seed=7)

    def unsupported(*args):
        raise launch_route.UnsupportedProgram("test: module holds stablehlo.multiply")

    monkeypatch.setattr(launch_route, "forward_launcher", unsupported)
    monkeypatch.setattr(launch_route, "backward_launcher", unsupported)
    monkeypatch.setattr(pallas_backends, "_unsupported", set())
    kw = dict(offset=1.0, casting="gemma")
    with pytest.warns(RuntimeWarning, match="using the DLPack route"):
        fallback = torch_results(x, w, dy, backend="pallas_launch", **kw)
    assert_same_bits(fallback, torch_results(x, w, dy, backend="pallas_dlpack", **kw))
