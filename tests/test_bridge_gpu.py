"""The bridge on a GPU: both Pallas routes (and the default alias) give JAX's bits at LLM sizes, the default route
and the Triton backend are captured by CUDA graphs and ``torch.compile(mode="reduce-overhead")`` with the eager
bits, no backend races torch's stream, device and host memory stay flat over 10k calls, and the launch route falls
back to DLPack when a lowered module is not a kernel chain."""

from __future__ import annotations

import gc
import os

import jax
import pytest
import torch

from torch_bridge import RMSNorm, launch_route, pallas_backends, rms_norm

from helpers import assert_same_bits, jax_results, torch_inputs, torch_results

pytestmark = pytest.mark.gpu


SHAPES = [
        ((8, 4096), torch.bfloat16, "llama", 0.0, None),
        ((32768, 4096), torch.bfloat16, "llama", 0.0, None),
        ((4096, 4096), torch.bfloat16, "gemma", 1.0, torch.float32),
        ((65536, 2304), torch.float16, "none", 0.0, None),
        ((64, 20000), torch.float32, "gemma", 1.0, None),
        ((1024, 262144), torch.bfloat16, "llama", 0.0, None),
        ((3, 65537), torch.bfloat16, "none", 0.0, None),
        ((8192, 32768), torch.bfloat16, "llama", 0.0, None),  # H100: Mosaic modules on clusters, both ways (H200:
        # the backward on column bands, auto.TRITON_BWD_BY_MODEL)
        ((2048, 65536), torch.bfloat16, "gemma", 1.0, None),
        ((4096, 2304), torch.bfloat16, "gemma", 1.0, None),  # H200: the forward on Mosaic GPU (MOSAIC_FWD_F32_BY_MODEL)
        ((32768, 5376), torch.bfloat16, "llama", 0.0, None),  # H200: jaxlib's launch (FWD_FFI_XLA_TILE_BY_MODEL)
        ((4096, 12288), torch.bfloat16, "llama", 0.0, None),  # H200: jaxlib's launch of (1, 16) (the same table)
]


@pytest.mark.parametrize("backend", ["pallas", "pallas_launch", "pallas_dlpack"])
@pytest.mark.parametrize("shape,dtype,casting,offset,weight_dtype", SHAPES, ids=str)
def test_pallas_routes_bit_identical_to_jax_on_gpu(shape, dtype, casting, offset, weight_dtype, backend):
    x, w, dy = torch_inputs(shape, dtype, offset, weight_dtype=weight_dtype, seed=4)
    kw = dict(eps=1e-6, offset=offset, casting=casting)
    assert_same_bits(torch_results(x, w, dy, backend=backend, **kw), jax_results(x, w, dy, **kw))


def test_launch_makes_the_primary_context_current_where_a_thread_has_none(monkeypatch):
    """A thread left without a current context (as a fresh process's first backward once was, after building its
    launcher: CUDA_ERROR_INVALID_CONTEXT) still launches: the primary context is made current and the launch
    retried, JAX's bits. Broken variant: without the retry the launch fails."""
    from torch_bridge import cuda_driver

    x, w, _ = torch_inputs((8, 4096), torch.bfloat16, 0.0, seed=4)
    launcher = launch_route.forward_launcher(8, 4096, x.dtype, w.dtype, 1e-6, 0.0, "llama", x.get_device())
    want = launcher(x, w)[0].clone()
    torch.cuda.synchronize()
    lib = cuda_driver._libcuda()
    lib.cuCtxSetCurrent(None)
    assert_same_bits(launcher(x, w)[0], want)
    torch.cuda.synchronize()
    monkeypatch.setattr(cuda_driver, "_INVALID_CONTEXT", -1)
    launch_route.forward_launcher.cache_clear()
    broken = launch_route.forward_launcher(8, 4096, x.dtype, w.dtype, 1e-6, 0.0, "llama", x.get_device())
    torch.cuda.synchronize()
    lib.cuCtxSetCurrent(None)
    with pytest.raises(cuda_driver.DriverUnavailable, match="INVALID_CONTEXT"):
        broken(x, w)
    lib.cuCtxSetCurrent(launcher.kernels[0].context)
    launch_route.forward_launcher.cache_clear()


def test_default_route_is_the_launch_route_on_cuda(monkeypatch):
    """``backend="pallas"`` runs ``pallas_launch`` for CUDA tensors: the DLPack route is never called."""
    x, w, dy = torch_inputs((8, 256), torch.bfloat16, 0.0, seed=2)

    def refuse(*args):
        raise AssertionError("the DLPack route ran")

    monkeypatch.setattr(pallas_backends.dlpack_route, "forward", refuse)
    monkeypatch.setattr(pallas_backends.dlpack_route, "backward", refuse)
    torch_results(x, w, dy, backend="pallas")
    with pytest.raises(AssertionError, match="the DLPack route ran"):
        torch_results(x, w, dy, backend="pallas_dlpack")
    module = RMSNorm(256, device="cuda")
    assert "backend='pallas' (runs 'pallas_launch')" in repr(module)


def graph_results(backend: str, shape=(8, 4096), dtype=torch.bfloat16, offset: float = 0.0, grad: bool = True,
                  **kw):
    """``(eager, replayed)``: y, dx, dweight of fwd+bwd (``grad``; else y of a forward without gradient) on fresh
    inputs, eagerly and by replaying a CUDA graph captured (after a warm-up on a side stream, as torch's docs ask)
    on other inputs, copied in before replay."""
    x0, w0, dy0 = torch_inputs(shape, dtype, offset, seed=1)
    x1, w1, dy1 = torch_inputs(shape, dtype, offset, seed=2)
    xs, ws, dys = x0.clone().requires_grad_(grad), w0.clone().requires_grad_(grad), dy0.clone()

    def step():
        y = rms_norm(xs, ws, backend=backend, offset=offset, **kw)
        return (y, *torch.autograd.grad(y, (xs, ws), dys)) if grad else (y,)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    with torch.no_grad():
        xs.copy_(x1), ws.copy_(w1), dys.copy_(dy1)
    graph.replay()
    replayed = [t.clone() for t in static]
    if not grad:
        return [rms_norm(x1, w1, backend=backend, offset=offset, **kw)], replayed
    return torch_results(x1, w1, dy1, backend=backend, offset=offset, **kw), replayed


@pytest.mark.parametrize("backend", ["pallas", "triton"])
@pytest.mark.parametrize("shape,offset,casting", [((8, 4096), 0.0, "llama"), ((4, 2, 65537), 1.0, "gemma")], ids=str)
def test_cuda_graph_capture_replays_the_eager_bits(backend, shape, offset, casting):
    eager, replayed = graph_results(backend, shape, offset=offset, casting=casting)
    assert_same_bits(replayed, eager)


def test_capture_check_catches_a_route_that_cannot_be_captured():
    """The DLPack route runs the kernels on JAX's stream, which a torch capture cannot record."""
    with pytest.raises(RuntimeError, match="captur"):
        graph_results("pallas_dlpack")


@pytest.mark.parametrize("backend", ["pallas", "triton"])
def test_forward_without_grad_gives_the_same_bits_and_is_captured(backend):
    """A call that will not be differentiated writes rstd into a shared scratch buffer: y keeps its bits while the
    scratch grows and is reused (M = 8, 8, 131074, 3), and a no-grad forward is captured by a CUDA graph."""
    for shape in [(8, 4096), (8, 4096), (2, 65537), (3, 4096)]:
        x, w, dy = torch_inputs(shape, torch.bfloat16, 0.0, seed=3)
        with torch.no_grad():
            y = rms_norm(x, w, backend=backend)
        assert_same_bits([y], torch_results(x, w, dy, backend=backend)[:1])
    eager, replayed = graph_results(backend, grad=False)
    assert torch.equal(replayed[0], eager[0])


@pytest.mark.parametrize("backend", ["pallas", "triton"])
def test_torch_compile_reduce_overhead_gives_the_eager_bits(backend):
    x, w, dy = torch_inputs((4, 6, 2048), torch.bfloat16, 1.0, seed=5)
    module = RMSNorm(2048, offset=1.0, casting="gemma", backend=backend, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        module.weight.copy_(w)
    compiled = torch.compile(module, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # warm-up runs, then replays of the recorded graph
        xg = x.clone().requires_grad_()
        y = compiled(xg)
        dx, dw = torch.autograd.grad(y, (xg, module.weight), dy)
        got = [y.detach().clone(), dx.clone(), dw.clone()]
    assert_same_bits(got, torch_results(x, w, dy, backend=backend, offset=1.0, casting="gemma"))


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


FLAT_BYTES = 4096  # device growth over 10k calls below this is no leak (see test_memory_flat_over_10k_calls)


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
    """Device memory (torch's allocator and JAX's) flat and host RSS within 16 MiB over 10k fwd+bwd calls. Flat
    means under 4 KiB: a leak of even one byte per call grows 10 KB here, while a buffer JAX frees asynchronously
    can still be counted at the second reading (256 B were, in 2 of about 6 runs of the DLPack route on the H100)."""
    x, w, dy = torch_inputs((8, 4096), torch.bfloat16, 0.0)
    x.requires_grad_(), w.requires_grad_()

    def step():
        rms_norm(x, w, backend=backend).backward(dy)
        x.grad = w.grad = None

    torch_growth, jax_growth, host_growth = memory_growth(step, 10_000)
    assert max(torch_growth, jax_growth) < FLAT_BYTES, (
        f"device memory grew: torch {torch_growth} B, JAX {jax_growth} B")
    assert host_growth < 16 * 2**20, f"host RSS grew {host_growth / 2**20:.1f} MiB over 10k calls"
    kept = []
    leaked = memory_growth(lambda: kept.append(rms_norm(x, w, backend=backend)), 100)
    assert max(leaked[:2]) >= FLAT_BYTES  # a leak shows


def test_launch_route_falls_back_to_dlpack(monkeypatch):
    x, w, dy = torch_inputs((5, 256), torch.bfloat16, 1.0, seed=7)

    def unsupported(*args):
        raise launch_route.UnsupportedProgram("test: module holds stablehlo.multiply")

    monkeypatch.setattr(launch_route, "forward_launcher", unsupported)
    monkeypatch.setattr(launch_route, "backward_launcher", unsupported)
    monkeypatch.setattr(pallas_backends, "_LAUNCHERS", {})
    kw = dict(offset=1.0, casting="gemma")
    with pytest.warns(RuntimeWarning, match="using the DLPack route"):
        fallback = torch_results(x, w, dy, backend="pallas_launch", **kw)
    assert_same_bits(fallback, torch_results(x, w, dy, backend="pallas_dlpack", **kw))
