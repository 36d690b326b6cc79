"""``python -m bench suite``: every provider at every shape and mode, the copy ceiling, peak memory and small-call
latency, side by side in one run (timers and byte counts: ``bench.timing``)."""

from __future__ import annotations

import itertools
import statistics

import jax
import torch
from rich.progress import Progress

from bench import report, timing
from bench.providers import Provider, providers

NS = (1024, 2048, 2304, 3584, 4096, 5120, 8192, 16384)
LONG = ((8192, 32768), (4096, 65536), (2048, 131072), (1024, 262144))  # M·N = 2^28
SHAPES = tuple(itertools.product((4096, 32768), NS)) + LONG
QUICK_SHAPES = ((4096, 4096), (32768, 4096), (32768, 2304), (4096, 16384), (1024, 262144))
SMALL_MS = (1, 8, 128)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


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
                  copy: float, modes: tuple[str, ...] = timing.MODES) -> list[dict]:
    x, w, dy = timing.inputs(m, n, dtype, offset)
    rows = []
    try:
        fns = p.build(x, w, dy, offset, casting)
        mem = None
        # one call of one input set (rotated sets would add up)
        if "fwd+bwd" in modes and getattr(fns["fwd+bwd"], "reps", 1) == 1:
            try:
                mem = peak_mb(p, fns["fwd+bwd"])
            except Exception:  # noqa: BLE001 - the fwd+bwd row records why
                pass
        for mode in modes:  # each mode on its own: a backward that cannot run leaves the forward's row
            try:
                sec = timing.time_kernels(fns[mode], timing.sync_any)
            except Exception as exc:  # OOM or a peer that cannot run this shape: recorded, never fatal
                rows.append(_error_row(p, mode, m, n, exc))
                continue
            tbps = timing.tbps(mode, m, n, x.element_size(), sec)
            rows.append(dict(provider=p.name, mode=mode, m=m, n=n, us=sec * 1e6, tbps=tbps, pct_copy=100 * tbps / copy,
                             **({} if mem is None else {"peak_mb": mem})))
    except Exception as exc:  # the provider cannot even be built here
        rows = [_error_row(p, mode, m, n, exc) for mode in modes]
    finally:
        del x, w, dy
        torch.cuda.empty_cache()
    return rows


def _error_row(p: Provider, mode: str, m: int, n: int, exc: Exception) -> dict:
    return dict(provider=p.name, mode=mode, m=m, n=n, error=f"{type(exc).__name__}: {str(exc)[:120]}")


def measure_small(provs: list[Provider], m: int, dtype: torch.dtype, casting: str, offset: float) -> list[dict]:
    """Small calls (M×4096, host-bound) of the torch providers, their loops taking turns
    (``timing.interleaved_samples``): ``us`` the median over rounds, ``x_torch`` the median of the per-round
    ratios to torch F.rms_norm (the host's speed drifts by up to 2× within minutes; ratios within a round hold)."""
    x, w, dy = timing.inputs(m, 4096, dtype, offset)
    rows, fns = [], {}
    for p in provs:
        try:
            built = p.build(x, w, dy, offset, casting)
            fns.update({(p.name, mode): built[mode] for mode in ("fwd", "fwd+bwd")})
        except Exception as exc:  # noqa: BLE001 - recorded as the provider's rows
            rows += [dict(provider=p.name, mode=mode, m=m, n=4096, small=True, error=f"{type(exc).__name__}: {exc}")
                     for mode in ("fwd", "fwd+bwd")]
    for mode in ("fwd", "fwd+bwd"):
        loops = {name: fn for (name, md), fn in fns.items() if md == mode}
        reps = {name: getattr(fn, "reps", 1) for name, fn in loops.items()}  # ops per call (rotated input sets)
        calls = max(10, 300 // max(reps.values(), default=1))
        samples = {name: [t / reps[name] for t in sec]
                   for name, sec in timing.interleaved_samples(loops, timing.torch_sync, calls, repeats=15).items()}
        for name, sec in samples.items():
            row = dict(provider=name, mode=mode, m=m, n=4096, us=1e6 * statistics.median(sec), small=True)
            if "torch_native" in samples:
                row["x_torch"] = timing.paired_ratio(samples, name, "torch_native")
            rows.append(row)
    return rows


def run(shapes, dtype: str, casting: str, small: bool = True, on_row=None, only=None,
        modes: tuple[str, ...] = timing.MODES) -> dict:
    """All measurements for one dtype and casting mode (offset 1 for "gemma", else 0), of every provider or those
    named in ``only``, in ``modes``; ``on_row(result)`` is called after each provider × shape (the CLI saves partial
    results there)."""
    offset = timing.casting_offset(casting)
    dt = DTYPES[dtype]
    provs = providers(only)
    copy = timing.copy_tbps()
    env = timing.environment(dtype=dtype, casting=casting, copy_tbps=copy, timer=report.KERNEL_TIMER)
    rows = []
    with Progress() as bar:
        n_torch = sum(p.framework == "torch" for p in provs)
        task = bar.add_task("bench", total=len(shapes) * len(provs) + (len(SMALL_MS) * n_torch if small else 0))
        for (m, n), p in itertools.product(shapes, provs):
            bar.update(task, description=f"{p.name} {m}x{n}")
            rows += measure_shape(p, m, n, dt, casting, offset, copy, modes)
            bar.advance(task)
            if on_row:
                on_row(dict(env=env, rows=rows))
        for m in SMALL_MS if small else ():
            bar.update(task, description=f"small calls M={m}")
            rows += measure_small([p for p in provs if p.framework == "torch"], m, dt, casting, offset)
            bar.advance(task, n_torch)
    return dict(env=env, rows=rows)
