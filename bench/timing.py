"""The benchmarks' one harness: timers, the copy ceiling, byte counts, inputs, the run's environment, file names.

Timing (the device library's METHOD.md): the suite times every provider, torch's and JAX's alike, by its kernels'
own durations (``time_kernels``: CUPTI via ``torch.profiler``, mean of 20 calls after warm-up and a 1 GB copy that
clears L2's hinted lines (``settle``), inputs rotated past L2; JAX offers no events on its stream, and CUDA events
around one torch call also time its host launch, which at small sizes is most of it), and so do the sweeps
(``time_sets``); the copy ceiling by ``triton.testing.do_bench`` (``time_torch``: CUDA events, warm-up, median, L2
flushed between calls); host-bound small calls by back-to-back loops with one synchronisation at the end
(``per_call``), as a training loop sees them. Bytes an RMSNorm must move: forward 2·M·N·s (read x, write y),
backward 3·M·N·s (read x and dy, write dx), fwd+bwd 5·M·N·s.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

EPS = 1e-6
MODES = ("fwd", "bwd", "fwd+bwd")
BYTES_PER_ELEM = {"fwd": 2, "bwd": 3, "fwd+bwd": 5}
NEEDS = "torch, triton and matplotlib (pip install 'pallas-norm[bench]')"
SETTLE_BYTES = 1 << 30  # ``settle``'s copy


def gpu_or_exit_code(prog: str) -> int | None:
    """None when torch sees a CUDA GPU; else print why ``prog`` cannot measure and return exit code 2."""
    try:
        import matplotlib  # noqa: F401
        import torch
        import triton  # noqa: F401
    except ImportError as err:
        print(f"{prog}: needs {NEEDS}: {err}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(f"{prog}: no CUDA GPU here (torch.cuda.is_available() is False); the benchmark only measures on a "
              "GPU.", file=sys.stderr)
        return 2
    return None


def kernel_us(run: Callable, calls: int, sync: Callable) -> dict[str, float]:
    """GPU µs per call of each kernel name over ``calls`` back-to-back calls of ``run()`` then ``sync(last
    output)``, as CUPTI records them through ``torch.profiler``: process-wide, so XLA's launches too."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            out = run()
        sync(out)
    return {e.key: e.self_device_time_total / calls for e in prof.key_averages() if e.device_type == DeviceType.CUDA}


def rotations(nbytes: int) -> int:
    """Copies of a call's inputs to rotate through so that together they pass the H100's 50 MB L2 (256 MB, at most
    8): each timed call then reads from memory, as inside a model."""
    return max(1, min(8, (256 << 20) // nbytes))


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"MxN,MxN,..."`` as ``[(M, N), ...]`` (the bench CLIs' ``--shapes`` and positional shapes)."""
    import argparse

    try:
        return [tuple(int(v) for v in s.split("x", 1)) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"shapes must be comma-separated MxN, got {text!r}") from None


def settle(nbytes: int = SETTLE_BYTES) -> None:
    """Copy ``nbytes`` (normal loads and stores) and wait: afterwards no line of L2 is still held at the
    ``evict_last`` priority that Triton gives a load hinted ``evict_last`` (ours, Inductor's), so a timing does not
    depend on what ran before it. Right after such a kernel, a kernel reading the same inputs ran 1-3.5% fast and one
    reading other data slow; a 256 MB read did not clear that, a 1 GB copy did
    (``bench/results/probes_h100_2026-11-27_thirtieth.md`` §5-6)."""
    import torch

    if torch.cuda.is_available():
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        torch.empty_like(src).copy_(src)
        torch.cuda.synchronize()


def settled_kernel_us(fn: Callable, sync: Callable, iters: int = 20) -> dict[str, float]:
    """``kernel_us`` of ``fn`` (µs per call of each kernel) after a warm-up call and ``settle``: how the suite times."""
    sync(fn())
    settle()
    return kernel_us(fn, iters, sync)


def time_kernels(fn: Callable, sync: Callable, iters: int = 20) -> float:
    """Seconds per op of ``fn()``'s GPU kernels (``fn.reps`` ops per call): their durations (``kernel_us``) over
    ``iters`` calls, after a warm-up call and ``settle``; ``sync(output)`` waits for them (``sync_any`` for torch and
    JAX alike).

    Not the wall clock of a loop of jitted calls: that read 5-17% below the same kernels' own durations on the
    H100 (host gaps between executables; 2026-11-24, ``docs/benchmarks.md``), while inside a model the norm is one
    op of a large jit (or of a torch graph whose host runs ahead of the GPU)."""
    us = sum(settled_kernel_us(fn, sync, iters).values())
    if us <= 0:
        raise RuntimeError("time_kernels: the profiler recorded no GPU kernel (is CUPTI available?)")
    return us * 1e-6 / getattr(fn, "reps", 1)


def input_sets(tensors: tuple) -> list[tuple]:
    """``rotations`` sets of torch ``tensors`` (sized by the first): the caller's own first (never written), then
    clones, so that a call per set reads from memory (``time_sets``)."""
    reps = rotations(tensors[0].numel() * tensors[0].element_size())
    return [tuple(tensors)] + [tuple(t.clone() for t in tensors) for _ in range(reps - 1)]


def time_sets(fn: Callable, sets: list[tuple], sync: Callable | None = None) -> float:
    """``time_kernels`` of ``fn(*s)`` for every input set ``s`` (``input_sets``) back to back: seconds per op."""

    def run():
        return [fn(*s) for s in sets]

    run.reps = len(sets)
    return time_kernels(run, sync or torch_sync)


def time_jax(fn: Callable, iters: int = 20) -> float:
    """``time_kernels`` of a JAX callable."""
    import jax

    return time_kernels(fn, jax.block_until_ready, iters)


def time_torch(fn: Callable) -> float:
    """Median seconds per call of ``fn()`` by ``triton.testing.do_bench``."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3


def per_call(fn: Callable, sync: Callable, calls: int, repeats: int = 7) -> float:
    """Median seconds per call of ``fn()`` over ``repeats`` back-to-back loops of ``calls`` calls, one ``sync``
    each (host-bound rate for small calls; the GPU's for large ones)."""
    for _ in range(max(10, calls // 10)):
        out = fn()
    sync(out)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = fn()
        sync(out)
        samples.append((time.perf_counter() - t0) / calls)
    return statistics.median(samples)


def interleaved_samples(fns: dict[str, Callable], sync: Callable, calls: int, repeats: int = 9
                        ) -> dict[str, list[float]]:
    """Seconds per call of each function in each of ``repeats`` rounds; in a round every function's loop of
    ``calls`` calls (one ``sync`` each) runs once, in turn: a host or GPU whose speed drifts during the run (the
    H100 host's did, by up to 1.7× between runs) shifts them together, so ratios within a round hold."""
    for fn in fns.values():
        for _ in range(max(10, calls // 10)):
            out = fn()
        sync(out)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                out = fn()
            sync(out)
            samples[name].append((time.perf_counter() - t0) / calls)
    return samples


def paired_ratio(samples: dict[str, list[float]], name: str, base: str) -> float:
    """The median over rounds of ``name``'s time / ``base``'s in the same round (robust to drift across rounds)."""
    return statistics.median(a / b for a, b in zip(samples[name], samples[base]))


@contextlib.contextmanager
def carveout(kernels, percent: int):
    """``kernels`` (a launcher's loaded ``CudaKernel``s) run at shared-memory carveout ``percent`` inside the block
    (100: what XLA's launch asks); the driver's default (-1) again after it (launchers are cached)."""
    for k in kernels:
        k.set_carveout(percent)
    try:
        yield
    finally:
        for k in kernels:
            k.set_carveout(-1)


def torch_sync(_=None) -> None:
    import torch

    torch.cuda.synchronize()


def sync_any(out=None) -> None:
    """Wait for ``out``'s JAX arrays (JAX may still be enqueueing them), then for the whole device (torch's work):
    one sync for loops of torch and JAX calls taking turns."""
    import jax

    jax.block_until_ready([a for a in jax.tree.leaves(out) if isinstance(a, jax.Array)])
    torch_sync()


def copy_tbps(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth, bytes read + written (torch ``copy_``, do_bench median)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    copy = functools.partial(torch.Tensor.copy_, torch.empty_like(src), src)
    tbps = 2 * nbytes / time_torch(copy) / 1e12
    del src, copy
    torch.cuda.empty_cache()
    return tbps


def tbps(mode: str, m: int, n: int, itemsize: int, seconds: float) -> float:
    return BYTES_PER_ELEM[mode] * m * n * itemsize / seconds / 1e12


def casting_offset(casting: str) -> float:
    """The weight offset the benchmarks pair with ``casting``: Gemma's 1 (``(1 + w)``), else 0."""
    return 1.0 if casting == "gemma" else 0.0


def inputs(m: int, n: int, dtype, offset: float, seed: int | None = None):
    """``(x, weight, dy)`` on the GPU: random data (never zeros), the weight around its init (Gemma: zeros)."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(m * 7 + n if seed is None else seed)
    x = torch.randn(m, n, generator=g, device="cuda").to(dtype)
    w = ((0.0 if offset else 1.0) + 0.1 * torch.randn(n, generator=g, device="cuda")).to(dtype)
    dy = torch.randn(m, n, generator=g, device="cuda").to(dtype)
    return x, w, dy


def hf_formula(offset: float, casting: str) -> Callable:
    """HF's module formula in eager torch: Gemma's for casting "gemma", else Llama's."""
    import torch

    def llama(x, w):
        h = x.float()
        return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)

    def gemma(x, w):
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * (offset + w.float())).type_as(x)

    return gemma if casting == "gemma" else llama


def environment(**extra) -> dict:
    """GPU, driver, library versions and date of this run, plus ``extra``."""
    import jax
    import torch
    import triton

    driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                            capture_output=True, text=True).stdout.strip()
    return dict(gpu=torch.cuda.get_device_name(), driver=driver, jax=jax.__version__, torch=torch.__version__,
                triton=triton.__version__, date=str(datetime.date.today()), **extra)


def versions(env: dict) -> str:
    """``"date · jax … · torch … · triton …"``: the line every bench table opens with, from ``environment``'s dict."""
    return f"{env['date']} · jax {env['jax']} · torch {env['torch']} · triton {env['triton']}"


def gpu_slug(gpu: str) -> str:
    """A file-name part for a GPU name: "NVIDIA H100 80GB HBM3" -> "h100", "NVIDIA H200" -> "h200" (the key of the
    kernels' per-model tables too: ``backend.model_slug``)."""
    from pallas_norm.backend import model_slug

    return model_slug(gpu)
