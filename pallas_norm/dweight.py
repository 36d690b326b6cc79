"""The Triton lowering's dweight reduction: the persistent backward's float32 partial rows (one per program; a band
grid's one per row group) summed into ``dweight`` in one fixed order, no atomics, so ``dweight`` is bitwise
reproducible (Mosaic GPU has its own, ``mosaic_kernels``)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import backend
from .pallas_config import cdiv, reduce_tile
from .tiles import F32, _span, _tile

# REDUCE_COLS columns per program of REDUCE_WARPS warps; lane r of a (REDUCE_ROWS, REDUCE_COLS) tile adds partial rows
# r, r + REDUCE_ROWS, ... in order, REDUCE_UNROLL tiles loaded before their adds, then the lanes are summed (a fixed
# order: the same bits every run, as the main kernels' own sums over a block's rows). A chain of loads, so the rows in
# flight per step set its speed. Thirteenth session: 1024 columns per program, one row at a time → 256 columns, 8 rows
# per step (the persistent grid's 132 partial rows 25-28 → 5 µs, bench/results/dweight_reduce_h100.md). Fourteenth
# session (H100, kernels timed from JAX, bench/results/dweight_reduce_h100.md): these tiles, 256 rows per step in
# 32-column programs: 132 partial rows 5.4 → 1.4-1.6 µs, 528 rows 2.3-3.4, 1056 rows 3.7-9.6 (one lane per column:
# 2.3, 6-9, 11-23); so the resident backward's grid could grow (pallas_config.BWD_RESIDENT). Fewer partial rows (a
# band grid's row groups) take fewer lanes and wider tiles (pallas_config.reduce_tile): 4 rows of 262144 columns 12.5
# → 2.7 µs. Sixteenth session: REDUCE_COLS is the most; short rows take fewer, about one program per SM
# (pallas_config.reduce_cols, inside reduce_tile: 528 partial rows of 1024 columns 2.7 → 2.1 µs).
REDUCE_ROWS = 32
REDUCE_COLS = 32
REDUCE_UNROLL = 8
REDUCE_WARPS = 8
REDUCE_MAX_COLS = 1024  # fewer partial rows take wider tiles up to this (pallas_config.reduce_tile)


def _dweight_reduce_kernel(dwp_ref, dw_ref, *, n: int, parts: int, lanes: int, cols: int):
    """``dweight[c] = Σ_p partials[p, c]`` in one fixed order (the same bits every run): lane r of a ``(lanes, cols)``
    tile adds rows r, r + lanes, r + 2·lanes, ... in that order (``backend.ordered_sum``, ``REDUCE_UNROLL`` tiles
    loaded before their adds), then the lanes are summed (``jnp.sum``; with one lane the order is p = 0, 1, ...)."""
    span, cmask = _span(pl.program_id(0) * cols, cols, n)

    def load(first, j):
        rows, rmask = _span((first + j) * lanes, lanes, parts)
        return _tile(dwp_ref, rows, rmask, span, cmask, dtype=None)

    acc = backend.ordered_sum(load, cdiv(parts, lanes), REDUCE_UNROLL, jnp.zeros((lanes, cols), F32))
    backend.store(dw_ref.at[span], jnp.sum(acc, axis=0).astype(dw_ref.dtype), cmask)


def reduce_dweight(partials, dtype, *, interpret: bool):
    """``dweight`` in ``dtype`` from float32 ``partials`` of shape ``(parts, n)``, summed in one fixed order
    (``_dweight_reduce_kernel``; the tile from ``reduce_tile``)."""
    parts, n = partials.shape
    lanes, cols = reduce_tile(parts, n, backend.num_sms(), REDUCE_ROWS, REDUCE_COLS, REDUCE_MAX_COLS)
    return pl.pallas_call(
        functools.partial(_dweight_reduce_kernel, n=n, parts=parts, lanes=lanes, cols=cols),
        out_shape=jax.ShapeDtypeStruct((n,), dtype), grid=(cdiv(n, cols),),
        compiler_params=backend.compiler_params(REDUCE_WARPS, interpret=interpret), interpret=interpret,
        name="pallas_norm_dweight_reduce",
    )(partials)
