"""The configs ``python -m bench sweep`` times (``bench.sweep``): the heuristic's (None) and alternatives around it for
the Pallas kernels on the Triton lowering (``pallas_configs``, with column bands: ``band_configs``), on Mosaic GPU
(``mosaic_configs``) and for the Triton reference (``triton_configs``).
"""

from __future__ import annotations

import dataclasses
import itertools

from pallas_norm import backend, band_tables, mosaic_config, pallas_config
from torch_bridge import triton_config

BAND_CANDIDATE_COLS = 8192  # below the heuristics' bands, rows longer than this also sweep band configs


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
    base = mosaic_config.heuristic(m, n, backward=backward, itemsize=itemsize)
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
    plans.add(mosaic_plan(None, m, n, rows, itemsize, backward))
    for g in grid:
        cfg = dataclasses.replace(base, **g)
        plan = mosaic_plan(cfg, m, n, rows, itemsize, backward)
        if plan not in plans:
            plans.add(plan)
            out.append(cfg)
    return out


def mosaic_plan(cfg, m: int, n: int, row_bytes: int, itemsize: int, backward: bool) -> mosaic_config.Plan | None:
    try:
        return mosaic_config.fit(cfg, m, n, row_bytes=row_bytes, weight_bytes=itemsize, widest=itemsize,
                                 backward=backward)
    except mosaic_config.Unsupported:
        return None


def triton_heuristic(n: int, backward: bool) -> triton_config.Config:
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
    base = triton_heuristic(n, backward)
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
