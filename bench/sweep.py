"""``python -m bench sweep``: our kernels (the Pallas kernels on both lowerings and the Triton reference) under
alternative tilings.

Each config is passed the way tests and autotuning pass it: ``pallas_config.Config`` (Triton lowering) or
``mosaic_config.MosaicConfig`` (Mosaic GPU) through the cached JAX functions (``api.forward_fn``/``backward_fn``,
compiled by XLA and launched from torch by ``launch_route``, so both kernel families are timed the same way: by
their kernels' durations over inputs rotated past L2, ``timing.time_sets``, as the suite times every provider),
``triton_config.Config`` to ``triton_kernels``. The heuristic's config is timed first
at every shape; the table marks the fastest per kernel, direction and shape, so a heuristic change can cite the
sweep that justifies it.
"""

from __future__ import annotations

import contextlib
import itertools
import sys

import torch

from bench import ptxas, sweep_configs, timing
from pallas_norm import mosaic_config, pallas_config
from torch_bridge import launch_route, triton_kernels

SHAPES = ((32768, 1024), (32768, 2048), (32768, 2304), (32768, 3584), (32768, 4096), (32768, 5120), (32768, 8192),
          (4096, 16384), (32768, 16384), (8192, 32768), (4096, 65536), (1024, 262144))
QUICK_SHAPES = ((32768, 4096),)
KERNELS = ("pallas", "mosaic", "triton")
MODES = ("fwd", "bwd")


def _pallas_rows(m: int, n: int, dtype, casting: str, quick: bool, kernel: str = "pallas",
                 modes: tuple[str, ...] = MODES, bands_only: bool = False, carveout: int | None = None) -> list[dict]:
    """Each config's kernels as XLA compiled them for the JAX API, launched from torch (``launch_route``) so they
    are timed like every torch kernel (``timing.time_sets``); their registers and spill bytes per thread from the driver
    (Triton lowering) or ptxas's report (Mosaic GPU, with the CTAs per SM those registers allow against those the
    plan's persistent grid asks for). ``kernel``: ``"pallas"`` (Triton lowering) or ``"mosaic"``. With
    ``carveout`` the Triton lowering's kernels are timed again with that shared-memory carveout (XLA's launch sets
    the most shared memory: ``bench carveout``), as ``tbps_carveout``."""
    x, w, dy = timing.inputs(m, n, dtype, 0.0)
    dev = x.get_device()
    rstd = launch_route.forward_launcher(m, n, x.dtype, w.dtype, timing.EPS, 0.0, casting, dev)(x, w)[1]
    sets = timing.input_sets((x, w, dy, rstd))
    rows = []
    for backward in _directions(modes):
        configs = (sweep_configs.pallas_configs(m, n, backward, quick, bands_only) if kernel == "pallas" else
                   sweep_configs.mosaic_configs(m, n, x.element_size(), backward, quick))
        for cfg in configs:
            if cfg is None:  # the kernel family's own heuristic (None would let ``auto`` pick the lowering)
                cfg = (mosaic_config if kernel == "mosaic" else pallas_config).heuristic(m, n, backward=backward)
            try:
                # Mosaic's runtime compiles at the launcher's first call: the report is captured around the timing
                with ptxas.capture() if kernel == "mosaic" else contextlib.nullcontext({}) as report:
                    if backward:
                        launcher = launch_route.backward_launcher(m, n, x.dtype, w.dtype, 0.0, casting, dev, cfg)
                        call = launcher
                    else:
                        launcher = launch_route.forward_launcher(m, n, x.dtype, w.dtype, timing.EPS, 0.0, casting,
                                                                 dev, cfg)
                        call = lambda a, b, _dy, _rstd, launcher=launcher: launcher(a, b)  # noqa: E731
                    row = _row(kernel, backward, m, n, x.element_size(), cfg, timing.time_sets(call, sets))
            except torch.AcceleratorError:  # the CUDA context is lost: nothing after this can run
                print(f"sweep: {kernel} {m}x{n} {'bwd' if backward else 'fwd'} {cfg!r} broke the CUDA context",
                      file=sys.stderr, flush=True)
                raise
            except Exception as err:  # noqa: BLE001  (a config this shape cannot take: recorded, the sweep goes on)
                rows.append(dict(kernel=kernel, mode="bwd" if backward else "fwd", m=m, n=n, config=repr(cfg),
                                 error=f"{type(err).__name__}: {str(err)[:160]}"))
                continue
            print(f"sweep: {kernel} {m}x{n} {row['mode']} {row['config']}: {row['tbps']:.2f} TB/s", file=sys.stderr,
                  flush=True)
            if carveout is not None and kernel == "pallas":
                with timing.carveout(launcher.kernels, carveout):
                    row["tbps_carveout"] = timing.tbps(row["mode"], m, n, x.element_size(),
                                                       timing.time_sets(call, sets))
            main = [k for k in launcher.kernels if "reduce" not in getattr(k, "name", "")][-1]  # not dweight's sum
            if hasattr(main, "registers"):
                row["resources"] = f"{main.registers} regs, {main.local_bytes} B spilled"
            elif kernel == "mosaic":
                size = x.element_size()
                plan = sweep_configs.mosaic_plan(cfg, m, n, size * (2 if backward else 1), size, backward)
                row["resources"] = ptxas.mosaic_resources(report, "bwd" if backward else "fwd", plan)
            rows.append(row)
    return rows


def _triton_rows(m: int, n: int, dtype, casting: str, quick: bool, modes: tuple[str, ...] = MODES,
                 bands_only: bool = False) -> list[dict]:
    x, w, dy = timing.inputs(m, n, dtype, 0.0)
    _, rstd = triton_kernels.rms_norm_fwd(x, w, timing.EPS, 0.0, casting)
    sets = timing.input_sets((x, w, dy, rstd))
    rows = []
    for backward in _directions(modes):
        for cfg in sweep_configs.triton_configs(n, backward, quick, bands_only):
            if backward:
                call = lambda a, b, g, r, cfg=cfg: triton_kernels.rms_norm_bwd(  # noqa: E731
                    g, a, b, r, 0.0, casting, True, True, config=cfg)
            else:
                call = lambda a, b, _g, _r, cfg=cfg: triton_kernels.rms_norm_fwd(  # noqa: E731
                    a, b, timing.EPS, 0.0, casting, config=cfg)
            rows.append(_row("triton", backward, m, n, x.element_size(), cfg, timing.time_sets(call, sets)))
    return rows


def _row(kernel: str, backward: bool, m: int, n: int, itemsize: int, cfg, sec: float) -> dict:
    mode = "bwd" if backward else "fwd"
    if kernel == "mosaic" and cfg == mosaic_config.heuristic(m, n, backward=backward):
        name = f"heuristic: {cfg!r}"
    elif kernel == "pallas" and cfg == pallas_config.heuristic(m, n, backward=backward):
        name = f"heuristic: {cfg!r}"
    elif cfg is None:  # the Triton reference's (the Pallas families' rows arrive with their heuristic's config)
        name = f"heuristic: {sweep_configs.triton_heuristic(n, backward)!r}"
    elif kernel == "pallas":  # as launched (``fit`` sets the grid: the band count, the persistent grid's size)
        name = repr(pallas_config.fit(cfg, m, n, backward=backward))
    else:
        name = repr(cfg)
    return dict(kernel=kernel, mode=mode, m=m, n=n, config=name, us=sec * 1e6,
                tbps=timing.tbps(mode, m, n, itemsize, sec))


def _directions(modes: tuple[str, ...]) -> list[bool]:
    """``backward`` flags of the ``modes`` swept ("fwd", "bwd"), forward first."""
    return [backward for backward, mode in ((False, "fwd"), (True, "bwd")) if mode in modes]


def run(shapes, dtype: str, casting: str, quick: bool, kernels: tuple[str, ...] = KERNELS,
        modes: tuple[str, ...] = MODES, bands_only: bool = False, carveout: int | None = None) -> dict:
    tdt = getattr(torch, dtype)
    copy = timing.copy_tbps()
    rows = []
    for m, n in shapes:
        for kernel in kernels:
            rows += (_triton_rows(m, n, tdt, casting, quick, modes, bands_only) if kernel == "triton" else
                     _pallas_rows(m, n, tdt, casting, quick, kernel, modes, bands_only, carveout))
        torch.cuda.empty_cache()
    return dict(env=timing.environment(dtype=dtype, casting=casting, copy_tbps=copy), rows=rows, carveout=carveout)


def markdown(result: dict) -> str:
    env, rows, carveout = result["env"], result["rows"], result.get("carveout")
    extra = ("", "") if carveout is None else (f" TB/s at carveout {carveout} |", "---|")
    out = [f"# Tiling sweep: {env['gpu']}, {env['dtype']}, casting={env['casting']}", "",
           f"{env['date']} · jax {env['jax']} · torch {env['torch']} · triton {env['triton']} · copy "
           f"{env['copy_tbps']:.2f} TB/s (this run). Made by `python -m bench sweep`; ★ fastest per group"
           + ("." if carveout is None else f", ☆ fastest at carveout {carveout} (XLA's launch, `bench carveout`)."),
           "", "| kernel | mode | M×N | config | µs | TB/s | % of copy |" + extra[0] + " main kernel |",
           "|---|---|---|---|---|---|---|" + extra[1] + "---|"]
    for key, group in itertools.groupby(rows, key=lambda r: (r["kernel"], r["mode"], r["m"], r["n"])):
        group = list(group)
        timed = [r for r in group if "tbps" in r]
        best = max(timed, key=lambda r: r["tbps"]) if timed else None
        at_carveout = [r for r in timed if "tbps_carveout" in r]
        best_carveout = max(at_carveout, key=lambda r: r["tbps_carveout"]) if at_carveout else None
        for r in group:
            if "tbps" not in r:
                out.append(f"| {r['kernel']} | {r['mode']} | {r['m']}×{r['n']} | {r['config']} | – | – | – | "
                           + "– | " * (carveout is not None) + f"{r['error']} |")
                continue
            marks = " ★" * (r is best) + " ☆" * (r is best_carveout)
            cell = "" if carveout is None else f" {r['tbps_carveout']:.2f} |" if "tbps_carveout" in r else " – |"
            out.append(f"| {r['kernel']} | {r['mode']} | {r['m']}×{r['n']} | {r['config']}{marks}"
                       f" | {r['us']:.1f} | {r['tbps']:.2f} | {100 * r['tbps'] / env['copy_tbps']:.0f}% |{cell}"
                       f" {r.get('resources', '')} |")
    return "\n".join(out) + "\n"
