"""Measure every provider at every shape and mode, the copy ceiling, peak memory and small-call latency.

Timing (the device library's METHOD.md): torch providers by ``triton.testing.do_bench`` (CUDA events, warm-up,
median, L2 flushed between calls; an eager provider whose host work outlasts its kernel is timed as host bound,
as eager torch runs it); JAX providers by a pipelined loop of jitted calls ending in ``block_until_ready``, after
warm-up, median of repeats, each call running the op on up to 8 rotated input sets (``providers.jax_modes``).
Small-call latency (torch providers only): back-to-back call loops, one sync at the end, as a training loop
sees them.
Bytes: fwd 2·M·N·s, bwd 3·M·N·s, fwd+bwd 5·M·N·s.
"""

from __future__ import annotations

import datetime
import itertools
import statistics
import subprocess
import time

import jax
import torch
import triton
from rich.progress import Progress
from triton.testing import do_bench

from bench.bridge_bench import per_call
from bench.providers import MODES, Provider, providers

NS = (1024, 2048, 2304, 3584, 4096, 5120, 8192, 16384, 65536)
SHAPES = tuple(itertools.product((4096, 32768), NS)) + ((1024, 262144),)
QUICK_SHAPES = ((4096, 4096), (32768, 4096), (32768, 2304), (1024, 262144))
SMALL_MS = (1, 8, 128)
BYTES_PER_ELEM = {"fwd": 2, "bwd": 3, "fwd+bwd": 5}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def time_jax(fn, iters: int = 10, repeats: int = 5) -> float:
    """Median seconds per call (pipelined loop, one sync per repeat)."""
    jax.block_until_ready(fn())
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn()
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / iters)
    return statistics.median(samples) / getattr(fn, "reps", 1)


def time_torch(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3


def copy_tbps(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth, bytes read + written (torch ``copy_``, do_bench median)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    tbps = 2 * nbytes / time_torch(lambda: dst.copy_(src)) / 1e12
    del src, dst
    torch.cuda.empty_cache()
    return tbps


def inputs(m: int, n: int, dtype: torch.dtype, offset: float):
    g = torch.Generator(device="cuda").manual_seed(m * 7 + n)
    x = torch.randn(m, n, generator=g, device="cuda").to(dtype)
    w = ((0.0 if offset else 1.0) + 0.1 * torch.randn(n, generator=g, device="cuda")).to(dtype)
    dy = torch.randn(m, n, generator=g, device="cuda").to(dtype)
    return x, w, dy


def peak_mb(p: Provider, run) -> float:
    """Extra device memory of one fwd+bwd call, MB: torch allocator peak over the baseline; for JAX providers
    (and the DLPack bridge, whose outputs JAX allocates) also JAX's bytes in use while the outputs are alive."""
    jdev = jax.devices()[0]
    torch.cuda.synchronize()
    base_t, base_j = torch.cuda.memory_allocated(), jdev.memory_stats()["bytes_in_use"]
    torch.cuda.reset_peak_memory_stats()
    out = run()
    jax.block_until_ready(out) if p.framework == "jax" else torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base_t + max(0, jdev.memory_stats()["bytes_in_use"] - base_j)
    del out
    return extra / 2**20


def measure_shape(p: Provider, m: int, n: int, dtype: torch.dtype, casting: str, offset: float,
                  copy: float) -> list[dict]:
    x, w, dy = inputs(m, n, dtype, offset)
    rows = []
    try:
        fns = p.build(x, w, dy, offset, casting)
        timer = time_jax if p.framework == "jax" else time_torch
        mem = peak_mb(p, fns["fwd+bwd"])
        for mode in MODES:
            sec = timer(fns[mode])
            tbps = BYTES_PER_ELEM[mode] * m * n * x.element_size() / sec / 1e12
            rows.append(dict(provider=p.name, mode=mode, m=m, n=n, us=sec * 1e6, tbps=tbps,
                             pct_copy=100 * tbps / copy, peak_mb=mem))
    except Exception as exc:  # OOM or a peer that cannot run this shape: recorded, never fatal
        rows = [dict(provider=p.name, mode=mode, m=m, n=n, error=f"{type(exc).__name__}: {str(exc)[:120]}")
                for mode in MODES]
    finally:
        del x, w, dy
        torch.cuda.empty_cache()
    return rows


def measure_small(p: Provider, m: int, dtype: torch.dtype, casting: str, offset: float) -> list[dict]:
    x, w, dy = inputs(m, 4096, dtype, offset)
    sync = jax.block_until_ready if p.framework == "jax" else (lambda _: torch.cuda.synchronize())
    try:
        fns = p.build(x, w, dy, offset, casting)
        return [dict(provider=p.name, mode=mode, m=m, n=4096, us=per_call(fns[mode], sync, 300) * 1e6, small=True)
                for mode in ("fwd", "fwd+bwd")]
    except Exception as exc:
        return [dict(provider=p.name, mode=mode, m=m, n=4096, small=True, error=f"{type(exc).__name__}: {exc}")
                for mode in ("fwd", "fwd+bwd")]


def environment(dtype: str, casting: str, copy: float) -> dict:
    driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                            capture_output=True, text=True).stdout.strip()
    return dict(gpu=torch.cuda.get_device_name(), driver=driver, jax=jax.__version__, torch=torch.__version__,
                triton=triton.__version__, date=str(datetime.date.today()), dtype=dtype, casting=casting,
                copy_tbps=copy)


def run(shapes, dtype: str, casting: str, small: bool = True, on_row=None) -> dict:
    """All measurements for one dtype and casting mode (offset 1 for "gemma", else 0); ``on_row(result)`` is
    called after each provider × shape (the CLI saves partial results there)."""
    offset = 1.0 if casting == "gemma" else 0.0
    dt = DTYPES[dtype]
    provs = providers()
    copy = copy_tbps()
    rows = []
    with Progress() as bar:
        n_torch = sum(p.framework == "torch" for p in provs)
        task = bar.add_task("bench", total=len(shapes) * len(provs) + (len(SMALL_MS) * n_torch if small else 0))
        for (m, n), p in itertools.product(shapes, provs):
            bar.update(task, description=f"{p.name} {m}x{n}")
            rows += measure_shape(p, m, n, dt, casting, offset, copy)
            bar.advance(task)
            if on_row:
                on_row(dict(env=environment(dtype, casting, copy), rows=rows))
        for m, p in itertools.product(SMALL_MS if small else (), [p for p in provs if p.framework == "torch"]):
            bar.update(task, description=f"small call {p.name} M={m}")
            rows += measure_small(p, m, dt, casting, offset)
            bar.advance(task)
    return dict(env=environment(dtype, casting, copy), rows=rows)
