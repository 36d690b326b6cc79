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
import dataclasses
import itertools
import sys

import torch

from bench import ptxas, timing
from pallas_norm import backend, band_tables, mosaic_config, pallas_config
from torch_bridge import launch_route, triton_config, triton_kernels

BAND_CANDIDATE_COLS = 8192  # below the heuristics' bands, rows longer than this also sweep band configs
SHAPES = ((32768, 1024), (32768, 2048), (32768, 2304), (32768, 3584), (32768, 4096), (32768, 5120), (32768, 8192),
          (4096, 16384), (32768, 16384), (8192, 32768), (4096, 65536), (1024, 262144))
QUICK_SHAPES = ((32768, 4096),)
KERNELS = ("pallas", "mosaic", "triton")
MODES = ("fwd", "bwd")


def pallas_configs(m: int, n: int, backward: bool, quick: bool,
                   bands_only: bool = False) -> list[pallas_config.Config | None]:
    """The heuristic's config (None) and alternatives around it: rows per program × warps (× prefetch for the
    backward) for resident rows; chunk width × warps × prefetch (× persistent grid size for the forward) for
    long rows, and band configs beyond ``BAND_CANDIDATE_COLS`` columns (``bands_only``: the heuristic's, the band
    heuristic's and ``band_candidates`` alone)."""
    base = pallas_config.heuristic(m, n, backward=backward)
    sms = backend.num_sms()
    if base.lag and bands_only:
        return [None] + band_candidates(base, n)
    if base.lag:  # column bands: band × rows × warps × lag × prefetch × row groups, and the chunked path
        return [None] + band_configs(base, n, backward, quick)
    extra = []
    if n > BAND_CANDIDATE_COLS:  # long rows off the bands: the band layout as a candidate (bands_only: and more)
        banded = pallas_config.bands_config(m, n, backward=backward, min_cols=0)
        extra = [banded] + (band_candidates(banded, n)[:4 if quick else None] if bands_only else [])
    if bands_only:
        return [None] + extra
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
                     and c.block_rows * c.block_cols <= 32768] + extra


def band_candidates(base: pallas_config.Config, n: int) -> list[pallas_config.Config]:
    """Band configs around ``base``: one-warp programs (no shared memory: XLA leaves them the driver's carveout) on
    band width × rows × lag × programs per SM; the same with the last ``lag`` blocks carried in registers
    (``carry``); then 2- to 8-warp programs, carried (band width × rows × lag × programs per SM, deeper lags)."""
    sms = backend.num_sms()

    def make(c, r, w, k, p, carry):
        bands = -(-n // c)
        return dataclasses.replace(base, block_cols=c, block_rows=r, num_warps=w, lag=k, prefetch=True, carry=carry,
                                   programs=bands * band_tables.band_groups(bands, p, sms))

    grid = [(c, r, 1, k, p, False) for c, r, k, p in itertools.product((1024, 2048), (1, 2), (1, 2, 3), (8, 16, 24))
            if c * r <= 2048 and (k == 2 or (r == 1 and p != 24))]
    grid += [(1024, 1, 1, 2, p, True) for p in (8, 16)] + [(512, 1, 1, 2, p, False) for p in (16, 24)]
    grid += [(c, r, 4, k, p, True) for c, r, k, p in itertools.product((1024, 2048), (1, 2), (1, 2), (2, 4, 8))
             if c * r <= 4096 and (k == 2 or r == 1)]
    grid += [(c, 1, 4, k, 4, True) for c, k in itertools.product((1024, 2048), (3, 4))]
    grid += [(2048, 1, 8, 2, p, True) for p in (2, 4)] + [(1024, 1, 2, 2, p, True) for p in (4, 8)]
    return [c for c in dict.fromkeys(make(*g) for g in grid) if c != base]


def band_configs(base: pallas_config.Config, n: int, backward: bool, quick: bool) -> list[pallas_config.Config]:
    """Alternatives to a band config: one row group (rows × warps × lag × prefetch), two and four row groups on
    smaller row blocks (more programs per SM, each holding less: ``programs`` = bands × groups), 2048-column bands
    in two groups; then the chunked path's configs. Configs whose grid cannot be co-resident run (the fallback)."""
    def make(cols, rows, warps, lag, prefetch, groups):
        return dataclasses.replace(base, block_cols=cols, block_rows=rows, num_warps=warps, lag=lag, prefetch=prefetch,
                                   programs=groups * -(-n // cols))

    flags = (False, True)
    grid = [(1024, r, 4, 2, p, 1) for r, p in itertools.product((4, 8), flags)]
    grid += [(1024, r, 4, k, p, 2) for r, k, p in itertools.product((1, 2, 4), (1, 2), flags)]
    grid += [(1024, r, 4, 2, p, 4) for r, p in itertools.product((1, 2), flags)]
    grid += [(2048, r, w, 2, True, 2) for r, w in itertools.product((1, 2), (4, 8))]
    grid += [(1024, 1, 4, k, True, 4) for k in (1, 3)] + [(1024, 1, w, 2, True, 8) for w in (2, 4)]
    grid += [(1024, 1, 8, 2, True, 4), (2048, 1, 4, 2, True, 4), (2048, 2, 4, 2, True, 4), (2048, 2, 4, 2, False, 2)]
    grid += [(2048, 2, 4, k, True, 2) for k in (1, 3)] + [(4096, 1, 4, 2, True, g) for g in (2, 4)]
    if backward:
        grid += [(1024, 4, 8, 2, False, g) for g in (1, 2)]
        chunked = [pallas_config.Config(1, c, 16) for c in (4096, 8192)]
    else:
        cols, warps, _, prefetch = pallas_config.FWD_CHUNKED
        chunked = [pallas_config.Config(1, cols, warps, prefetch=prefetch)]
    configs = list(dict.fromkeys(make(*g) for g in (grid[::3] if quick else grid)))
    return [c for c in configs if c != base] + band_candidates(base, n)[:2 if quick else None] + chunked


def mosaic_configs(m: int, n: int, itemsize: int, backward: bool,
                   quick: bool) -> list[mosaic_config.MosaicConfig | None]:
    """The heuristic's config (None) and alternatives around it: the direct forward's rows per CTA, and the staged
    forward (stages × co-resident CTAs) beside it; stages × co-resident CTAs (and rows per block around the
    heuristic's) for the backward of rows one CTA holds; cluster size × co-resident CTAs × stages for long rows; the
    heuristic's with the row held in registers and without. Configs that ``fit`` shrinks to the same plan are timed
    once."""
    base = mosaic_config.heuristic(m, n, backward=backward)
    if base.direct:
        grid = [dict(block_rows=r) for r in (2, 4)] + [
            dict(direct=False, stages=s, programs_per_sm=p, block_rows=max(1, 2048 // pallas_config.next_pow2(n)))
            for s, p in itertools.product((2, 3), (1, 2, 4) if not quick else (2,))]
    elif base.cluster is None:  # rows one CTA holds
        grid = [dict(stages=s, programs_per_sm=p) for s, p in itertools.product(
            (2, 3) if quick else (2, 3, 4), (2, 4) if quick else (1, 2, 3, 4, 6, 8))]
        grid += [] if quick else [dict(block_rows=r, programs_per_sm=p) for r, p in itertools.product(
            {max(1, base.block_rows // 2), 2 * base.block_rows} - {base.block_rows}, (2, 4, 8))]
    else:
        grid = [dict(cluster=c, programs_per_sm=p, stages=s) for c, p, s in itertools.product(
            (2, 4, 8, 16), (1, 2) if quick else (1, 2, 4), (1, 2) if quick else (1, 2, 3))]
        grid += [] if quick else [dict(cluster=c, programs_per_sm=p, stages=s, weight_in_smem=False) for c in (8, 16)
                                  for p, s in itertools.product((2, 4), (1, 2, 3))]  # the weight from L2: more CTAs
    grid += [dict(hold=h) for h in (False, True)]  # the row read again, or held in registers, between the walks
    rows = itemsize * (2 if backward else 1)
    plans, out = {None}, [None]
    plans.add(_mosaic_plan(None, m, n, rows, itemsize, backward))
    for g in grid:
        cfg = dataclasses.replace(base, **g)
        plan = _mosaic_plan(cfg, m, n, rows, itemsize, backward)
        if plan not in plans:
            plans.add(plan)
            out.append(cfg)
    return out


def _mosaic_plan(cfg, m: int, n: int, row_bytes: int, itemsize: int, backward: bool) -> mosaic_config.Plan | None:
    try:
        return mosaic_config.fit(cfg, m, n, row_bytes=row_bytes, weight_bytes=itemsize, widest=itemsize,
                                 backward=backward)
    except mosaic_config.Unsupported:
        return None


def _triton_heuristic(n: int, backward: bool) -> triton_config.Config:
    """The reference's heuristic for llama's 16-bit rows (both directions' ``low``, their products in the row dtype;
    the forward's default)."""
    if backward:
        return triton_config.backward_config(n, backend.num_sms(), False, True)
    return triton_config.forward_config(n, backend.num_sms())


def triton_band_candidates(n: int, backward: bool) -> list[triton_config.Config]:
    """Band configs of the Triton reference for rows it does not band (longer than ``BAND_CANDIDATE_COLS``): the
    band heuristic's layout (one-warp programs on 1024-column bands of one row, lag 2) at 4, 8 and 16 programs per
    SM, and 4-warp programs on 2048-column bands (1 or 2 rows) at 2 to 8."""
    sms = backend.num_sms()
    base = triton_config.bands_config(n, sms, backward=backward, min_n=0)
    if base is None:
        return []
    groups = lambda cols, per_sm: band_tables.band_groups(-(-n // cols), per_sm, sms)  # noqa: E731
    out = [dataclasses.replace(base, block_n=1024, block_m=1, num_warps=1, groups=groups(1024, p)) for p in (4, 8, 16)]
    out += [dataclasses.replace(base, block_n=2048, block_m=r, num_warps=4, groups=groups(2048, p))
            for r, p in ((1, 4), (1, 8), (2, 2), (2, 4))]
    return list(dict.fromkeys(out))


def triton_configs(n: int, backward: bool, quick: bool, bands_only: bool = False) -> list[triton_config.Config | None]:
    """The Triton reference's heuristic (None) and alternatives around it (``bands_only``: its band configs alone,
    or for rows it does not band, ``triton_band_candidates``)."""
    base = _triton_heuristic(n, backward)
    extra = triton_band_candidates(n, backward) if not base.lag and n > BAND_CANDIDATE_COLS else []
    if bands_only and not base.lag:
        return [None] + extra
    if base.lag:  # column bands: band × rows × lag × row groups (4 warps; one warp), and the chunked path
        grid = [(c, r, k, g) for c, r, k, g in itertools.product((1024, 2048), (1, 2, 4), (1, 2, 3), (1, 2, 4))
                if c * r <= 4096 * (1 if backward else 2) and (k == 2 or (c, r) in ((1024, 1), (2048, 2)))]
        configs = [dataclasses.replace(base, block_n=c, block_m=r, lag=k, groups=g, num_warps=4) for c, r, k, g in grid]
        configs += [dataclasses.replace(base, block_n=1024, block_m=1, lag=2, groups=g, num_warps=1)  # one warp
                    for g in (2, 4, 8, 16)]
        chunked = triton_config.chunked_backward_config() if backward else triton_config.chunked_forward_config()
        return [None] + [c for c in dict.fromkeys(configs) if c != base][:6 if quick else None] + [chunked]
    if not base.chunked(n):
        grid = [dict(block_m=max(1, e // base.block_n), num_warps=w) for e, w in itertools.product(
            (2048, 4096, 8192), (2, 4, 8))]
        if backward:
            grid += [dict(programs_per_sm=p) for p in (1, 3)]
            grid += [dict(prefetch=not base.prefetch)]
            grids = [*itertools.product((4096, 8192), (8, 16), (1, 2)),  # the Pallas design's, then more, smaller
                     (2048, 4, 4), (2048, 8, 4), (1024, 2, 8), (4096, 8, 4)]
            grid += [dict(block_m=max(1, e // base.block_n), num_warps=w, programs_per_sm=p, prefetch=True)
                     for e, w, p in grids]
    else:
        grid = [dict(block_n=c, num_warps=w) for c, w in itertools.product((4096, 8192, 16384), (8, 16))]
        if not backward and not quick:  # the long-row forward's persistent grid
            grid += [dict(block_n=16384, num_warps=w, programs_per_sm=p)
                     for w, p in itertools.product((16, 32), (1, 2, 4))]
    return [None] + [dataclasses.replace(base, **g) for g in (grid[:3] if quick else grid)] + extra


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
        configs = (pallas_configs(m, n, backward, quick, bands_only) if kernel == "pallas" else
                   mosaic_configs(m, n, x.element_size(), backward, quick))
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
                plan = _mosaic_plan(cfg, m, n, x.element_size() * (2 if backward else 1), x.element_size(), backward)
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
        for cfg in triton_configs(n, backward, quick, bands_only):
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
        name = f"heuristic: {_triton_heuristic(n, backward)!r}"
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
