"""``python -m bench sweep``: our kernels (Pallas in JAX and the Triton reference) under alternative tilings.

Each config is passed the way tests and autotuning pass it: ``pallas_config.Config`` through the cached JAX
functions (``api.forward_fn``/``backward_fn``), ``triton_config.Config`` to ``triton_kernels``. The heuristic's
config is timed first at every shape; the table marks the fastest per kernel, direction and shape, so a
heuristic change can cite the sweep that justifies it.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import torch

from bench import timing
from pallas_norm import api, pallas_config
from torch_bridge import triton_config, triton_kernels

SHAPES = ((32768, 4096), (4096, 16384), (1024, 262144))
QUICK_SHAPES = ((32768, 4096),)


def pallas_configs(m: int, n: int, backward: bool, quick: bool) -> list[pallas_config.Config | None]:
    base = pallas_config.heuristic(m, n, backward=backward)
    if base.resident(n):
        rows = (1, 2) if quick else (1, 2, 4)
        grid = [dict(block_rows=r, num_warps=w) for r, w in itertools.product(rows, (4, 8, 16))]
        if backward and not quick:
            grid += [dict(block_rows=1, num_warps=16, programs=p) for p in (132, 264, 396)]
    else:
        grid = [dict(block_cols=c, num_warps=w) for c, w in itertools.product((2048, 4096, 8192), (4, 8, 16))]
    return [None] + [dataclasses.replace(base, **g) for g in (grid[:3] if quick else grid)]


def triton_configs(n: int, backward: bool, quick: bool) -> list[triton_config.Config | None]:
    base = (triton_config.backward_config if backward else triton_config.forward_config)(n)
    if not base.chunked(n):
        grid = [dict(block_m=max(1, e // base.block_n), num_warps=w) for e, w in itertools.product(
            (2048, 4096, 8192), (2, 4, 8))]
        if backward:
            grid += [dict(programs_per_sm=p) for p in (1, 3)]
    else:
        grid = [dict(block_n=c, num_warps=w) for c, w in itertools.product((4096, 8192, 16384), (8, 16))]
    return [None] + [dataclasses.replace(base, **g) for g in (grid[:3] if quick else grid)]


def _pallas_rows(m: int, n: int, dtype, casting: str, quick: bool) -> list[dict]:
    kx, kw, kd = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (m, n), jnp.float32).astype(dtype)
    w = (1 + 0.1 * jax.random.normal(kw, (n,), jnp.float32)).astype(dtype)
    dy = jax.random.normal(kd, (m, n), jnp.float32).astype(dtype)
    rstd = jax.jit(api.forward_fn(timing.EPS, 0.0, casting, "pallas"))(x, w)[1]
    rows = []
    for backward in (False, True):
        for cfg in pallas_configs(m, n, backward, quick):
            if backward:
                fn = jax.jit(api.backward_fn(0.0, casting, "pallas", True, cfg))
                call = lambda fn=fn: fn(x, w, dy, rstd)  # noqa: E731
            else:
                fn = jax.jit(api.forward_fn(timing.EPS, 0.0, casting, "pallas", cfg))
                call = lambda fn=fn: fn(x, w)  # noqa: E731
            rows.append(_row("pallas", backward, m, n, jnp.dtype(dtype).itemsize, cfg, timing.time_jax(call)))
    return rows


def _triton_rows(m: int, n: int, dtype, casting: str, quick: bool) -> list[dict]:
    x, w, dy = timing.inputs(m, n, dtype, 0.0)
    _, rstd = triton_kernels.rms_norm_fwd(x, w, timing.EPS, 0.0, casting)
    rows = []
    for backward in (False, True):
        for cfg in triton_configs(n, backward, quick):
            if backward:
                call = lambda cfg=cfg: triton_kernels.rms_norm_bwd(dy, x, w, rstd, 0.0, casting, True, True,  # noqa
                                                                   config=cfg)
            else:
                call = lambda cfg=cfg: triton_kernels.rms_norm_fwd(x, w, timing.EPS, 0.0, casting, config=cfg)  # noqa
            rows.append(_row("triton", backward, m, n, x.element_size(), cfg, timing.time_torch(call)))
    return rows


def _row(kernel: str, backward: bool, m: int, n: int, itemsize: int, cfg, sec: float) -> dict:
    mode = "bwd" if backward else "fwd"
    if cfg is None:
        heuristic = (pallas_config.heuristic(m, n, backward=backward) if kernel == "pallas" else
                     (triton_config.backward_config if backward else triton_config.forward_config)(n))
        name = f"heuristic: {heuristic!r}"
    else:
        name = repr(cfg)
    return dict(kernel=kernel, mode=mode, m=m, n=n, config=name, us=sec * 1e6,
                tbps=timing.tbps(mode, m, n, itemsize, sec))


def run(shapes, dtype: str, casting: str, quick: bool) -> dict:
    jdt, tdt = jnp.dtype(dtype), getattr(torch, dtype)
    copy = timing.copy_tbps()
    rows = []
    for m, n in shapes:
        rows += _pallas_rows(m, n, jdt, casting, quick) + _triton_rows(m, n, tdt, casting, quick)
        torch.cuda.empty_cache()
    return dict(env=timing.environment(dtype=dtype, casting=casting, copy_tbps=copy), rows=rows)


def markdown(result: dict) -> str:
    env, rows = result["env"], result["rows"]
    out = [f"# Tiling sweep: {env['gpu']}, {env['dtype']}, casting={env['casting']}", "",
           f"{env['date']} · jax {env['jax']} · torch {env['torch']} · triton {env['triton']} · copy "
           f"{env['copy_tbps']:.2f} TB/s (this run). Made by `python -m bench sweep`; ★ fastest per group.", "",
           "| kernel | mode | M×N | config | µs | TB/s | % of copy |", "|---|---|---|---|---|---|---|"]
    for key, group in itertools.groupby(rows, key=lambda r: (r["kernel"], r["mode"], r["m"], r["n"])):
        group = list(group)
        best = max(group, key=lambda r: r["tbps"])
        for r in group:
            out.append(f"| {r['kernel']} | {r['mode']} | {r['m']}×{r['n']} | {r['config']}{' ★' if r is best else ''}"
                       f" | {r['us']:.1f} | {r['tbps']:.2f} | {100 * r['tbps'] / env['copy_tbps']:.0f}% |")
    return "\n".join(out) + "\n"
