"""``python -m bench sweep``: our kernels (the Pallas kernels and the Triton reference) under alternative tilings.

Each config is passed the way tests and autotuning pass it: ``pallas_config.Config`` through the cached JAX
functions (``api.forward_fn``/``backward_fn``, compiled by XLA and launched from torch by ``launch_route``, so both
kernel families are timed the same way, by ``triton.testing.do_bench``), ``triton_config.Config`` to
``triton_kernels``. The heuristic's config is timed first at every shape; the table marks the fastest per kernel,
direction and shape, so a heuristic change can cite the sweep that justifies it.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch

from bench import timing
from pallas_norm import backend, pallas_config
from torch_bridge import launch_route, triton_config, triton_kernels

SHAPES = ((32768, 1024), (32768, 2048), (32768, 2304), (32768, 3584), (32768, 4096), (32768, 5120), (32768, 8192),
          (4096, 16384), (32768, 16384), (8192, 32768), (4096, 65536), (1024, 262144))
QUICK_SHAPES = ((32768, 4096),)


def pallas_configs(m: int, n: int, backward: bool, quick: bool) -> list[pallas_config.Config | None]:
    """The heuristic's config (None) and alternatives around it: rows per program × warps (× prefetch for the
    backward) for resident rows; chunk width × warps × prefetch (× persistent grid size for the forward) for
    long rows."""
    base = pallas_config.heuristic(m, n, backward=backward)
    sms = backend.num_sms()
    if base.resident(n):
        rows = (1, 2) if quick else (1, 2, 4, 8, 16) if base.block_cols <= 2048 else (1, 2, 4)
        warps = (8, 16) if quick else (4, 8, 16, 32)
        grid = [dict(block_rows=r, num_warps=w, prefetch=p) for r, w, p in
                itertools.product(rows, warps, (False, True) if backward else (False,))]
        if backward and not quick:
            grid += [dict(programs=p * sms, prefetch=f) for p, f in itertools.product((1, 3), (False, True))]
            if base.block_cols >= 8192:  # long resident rows: the weight out of registers
                grid += [dict(num_warps=w, programs=p * sms, prefetch=f, reload_weight=True)
                         for w, p, f in itertools.product((16, 32), (1, 2), (False, True))]
    else:
        cols, warps = ((4096, 8192), (16,)) if quick else ((2048, 4096, 8192, 16384), (8, 16, 32))
        grid = [dict(block_cols=c, num_warps=w, prefetch=p) for c, w, p in
                itertools.product(cols, warps, (False, True))]
        if not backward and not quick:  # fewer rows in flight: more of a row still in L2 when it is read again
            grid += [dict(block_cols=16384, num_warps=w, programs=p, prefetch=True)
                     for w, p in itertools.product((16, 32), (sms // 2, sms, 4 * sms))]
    configs = [dataclasses.replace(base, **g) for g in grid]
    return [None] + [c for c in configs if c.block_rows * c.block_cols >= 32 * c.num_warps
                     and c.block_rows * c.block_cols <= 32768]


def triton_configs(n: int, backward: bool, quick: bool) -> list[triton_config.Config | None]:
    base = (triton_config.backward_config if backward else triton_config.forward_config)(n)
    if not base.chunked(n):
        grid = [dict(block_m=max(1, e // base.block_n), num_warps=w) for e, w in itertools.product(
            (2048, 4096, 8192), (2, 4, 8))]
        if backward:
            grid += [dict(programs_per_sm=p) for p in (1, 3)]
    else:
        grid = [dict(block_n=c, num_warps=w) for c, w in itertools.product((4096, 8192, 16384), (8, 16))]
        if not backward and not quick:  # the long-row forward's persistent grid
            grid += [dict(block_n=16384, num_warps=w, programs_per_sm=p)
                     for w, p in itertools.product((16, 32), (1, 2, 4))]
    return [None] + [dataclasses.replace(base, **g) for g in (grid[:3] if quick else grid)]


def _pallas_rows(m: int, n: int, dtype, casting: str, quick: bool) -> list[dict]:
    """Each config's kernels as XLA compiled them for the JAX API, launched from torch (``launch_route``) so they
    are timed by CUDA events like every torch kernel; their registers and spill bytes per thread from the driver."""
    x, w, dy = timing.inputs(m, n, dtype, 0.0)
    dev = x.get_device()
    rstd = launch_route.forward_launcher(m, n, x.dtype, w.dtype, timing.EPS, 0.0, casting, dev)(x, w)[1]
    rows = []
    for backward in (False, True):
        for cfg in pallas_configs(m, n, backward, quick):
            if backward:
                launcher = launch_route.backward_launcher(m, n, x.dtype, w.dtype, 0.0, casting, dev, cfg)
                call = lambda launcher=launcher: launcher(x, w, dy, rstd)  # noqa: E731
            else:
                launcher = launch_route.forward_launcher(m, n, x.dtype, w.dtype, timing.EPS, 0.0, casting, dev, cfg)
                call = lambda launcher=launcher: launcher(x, w)  # noqa: E731
            row = _row("pallas", backward, m, n, x.element_size(), cfg, timing.time_torch(call))
            main = launcher.kernels[-2 if backward else 0]  # the backward's last kernel sums dweight
            row["resources"] = f"{main.registers} regs, {main.local_bytes} B spilled"
            rows.append(row)
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
    tdt = getattr(torch, dtype)
    copy = timing.copy_tbps()
    rows = []
    for m, n in shapes:
        rows += _pallas_rows(m, n, tdt, casting, quick) + _triton_rows(m, n, tdt, casting, quick)
        torch.cuda.empty_cache()
    return dict(env=timing.environment(dtype=dtype, casting=casting, copy_tbps=copy), rows=rows)


def markdown(result: dict) -> str:
    env, rows = result["env"], result["rows"]
    out = [f"# Tiling sweep: {env['gpu']}, {env['dtype']}, casting={env['casting']}", "",
           f"{env['date']} · jax {env['jax']} · torch {env['torch']} · triton {env['triton']} · copy "
           f"{env['copy_tbps']:.2f} TB/s (this run). Made by `python -m bench sweep`; ★ fastest per group.", "",
           "| kernel | mode | M×N | config | µs | TB/s | % of copy | main kernel |", "|---|---|---|---|---|---|---|---|"]
    for key, group in itertools.groupby(rows, key=lambda r: (r["kernel"], r["mode"], r["m"], r["n"])):
        group = list(group)
        best = max(group, key=lambda r: r["tbps"])
        for r in group:
            out.append(f"| {r['kernel']} | {r['mode']} | {r['m']}×{r['n']} | {r['config']}{' ★' if r is best else ''}"
                       f" | {r['us']:.1f} | {r['tbps']:.2f} | {100 * r['tbps'] / env['copy_tbps']:.0f}% |"
                       f" {r.get('resources', '')} |")
    return "\n".join(out) + "\n"
