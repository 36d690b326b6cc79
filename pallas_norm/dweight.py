"""The Triton lowering's dweight reduction: the persistent backward's float32 partial rows (one per program; a band
grid's one per row group) summed into ``dweight`` in one fixed order, no atomics, so ``dweight`` is bitwise
reproducible (Mosaic GPU has its own, ``mosaic_kernels``); and the reduction's tile (``reduce_tile``), which the
Triton reference's reduction (``torch_bridge.triton_dweight``) shares."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import backend
from .pallas_config import cdiv, next_pow2
from .tiles import F32, _span, _tile

# REDUCE_COLS columns per program of REDUCE_WARPS warps; lane r of a (REDUCE_ROWS, REDUCE_COLS) tile adds partial rows
# r, r + REDUCE_ROWS, ... in order, REDUCE_UNROLL tiles loaded before their adds, then the lanes are summed (a fixed
# order: the same bits every run, as the main kernels' own sums over a block's rows). A chain of loads, so the rows in
# flight per step set its speed. Thirteenth session: 1024 columns per program, one row at a time → 256 columns, 8 rows
# per step (the persistent grid's 132 partial rows 25-28 → 5 µs, bench/results/dweight_reduce_h100.md). Fourteenth
# session (H100, kernels timed from JAX, bench/results/dweight_reduce_h100.md): these tiles, 256 rows per step in
# 32-column programs: 132 partial rows 5.4 → 1.4-1.6 µs, 528 rows 2.3-3.4, 1056 rows 3.7-9.6 (one lane per column:
# 2.3, 6-9, 11-23); so the resident backward's grid could grow (pallas_config.BWD_RESIDENT). Fewer partial rows (a
# band grid's row groups) take fewer lanes and wider tiles (reduce_tile): 4 rows of 262144 columns 12.5
# → 2.7 µs. Sixteenth session: REDUCE_COLS is the most; short rows take fewer, about one program per SM
# (reduce_cols, inside reduce_tile: 528 partial rows of 1024 columns 2.7 → 2.1 µs).
REDUCE_ROWS = 32
REDUCE_COLS = 32
REDUCE_UNROLL = 8
REDUCE_WARPS = 8
REDUCE_MAX_COLS = 1024  # fewer partial rows take wider tiles up to this (reduce_tile)
# reduce_dweight's tiles of at least REDUCE_WIDE_COLS columns take at most REDUCE_WIDE_ROWS lanes, not REDUCE_ROWS
# (``jax_reduce_tile``; the Triton reference's reduction keeps its own tile). Twenty-eighth session (H100,
# bf16, the reduction's duration inside impl=None's backward, kernels timed, alternating;
# probes_h100_2026-11-27_twentyeighth.md): 528 partial rows of 2304 columns 2.81 → 2.62 µs (4096×2304 backward
# 2.34 → 2.35 TB/s), 264 of 5120 2.77 → 2.64, 528 of 2304 at 32768 rows 2.71 → 2.50, 256 of 2048 1.95 → 1.89, 128
# of 4096 level; 8-column tiles (1024 columns) keep 32 lanes: 16 there took 528 partial rows 2.00 → 2.25 µs. Band
# grids of 64 and 32 row groups (16384, 32768 columns) take 16 lanes too; twenty-ninth session (impl="pallas", the
# same method, probes_h100_2026-11-27_twentyninth.md §2), 32 → 16 lanes: 4096×16384 2.56-2.59 → 2.19-2.27 µs,
# 8192×32768 3.06 → 2.55-2.57, 32768×16384 level (3.05-3.11 / 2.93-3.08). Fewer groups keep their wide tiles
# (halving them took 1024×262144's reduction 2.72 → 3.04 µs).
REDUCE_WIDE_ROWS = 16
REDUCE_WIDE_COLS = 16
# The dweight reductions' columns per program, at least (``reduce_cols``): 8 float32 columns are one 32-byte sector
# of a partial row. Sixteenth session (H100, bf16, the reduction's duration inside impl=None's backward, kernels
# timed from JAX; bench/results/dweight_reduce_h100.md): the Triton lowering's 32-column programs left most SMs idle
# where rows are short and partial rows many; about one program per SM instead: 528 partial rows of 1024 columns
# (the resident grid of 4 programs per SM) 2.66 → 2.10 µs, 4096×1024 backward 1.90 → 1.99 TB/s; 264 of 2048 2.22 →
# 2.06; 132 of 3584-8192 columns keep 32 (16 was 0.1-0.2 µs slower there).
REDUCE_MIN_COLS = 8


def reduce_cols(n: int, cols: int, sms: int) -> int:
    """Columns per program of a dweight reduction over partial rows of ``n`` columns on a GPU of ``sms`` SMs: ``cols``
    at most, fewer (down to ``REDUCE_MIN_COLS``) where that many would leave SMs without a program (both stacks'
    reductions). The partial rows each lane adds do not depend on it; the lanes' final sum follows the tile's layout,
    fixed per shape (the same bits on every call)."""
    return min(cols, max(REDUCE_MIN_COLS, next_pow2(cdiv(n, sms))))


def reduce_tile(parts: int, n: int, sms: int, rows: int, cols: int, max_cols: int) -> tuple[int, int]:
    """``(lanes, columns)`` of a dweight reduction's tile for ``parts`` partial rows of ``n`` columns on a GPU of
    ``sms`` SMs (both stacks' reductions): up to ``rows`` lanes, fewer for fewer partial rows (the next power of
    two), and then wider, keeping ``rows·c`` elements per tile up to ``max_cols`` columns, where ``c`` is
    ``reduce_cols(n, cols, sms)`` (a band grid's handful of partial rows over 262144 columns would otherwise launch
    thousands of programs loading mostly masked tiles)."""
    lanes = min(rows, next_pow2(max(parts, 1)))
    return lanes, min(max_cols, rows * reduce_cols(n, cols, sms) // lanes)


def jax_reduce_tile(parts: int, n: int, sms: int) -> tuple[int, int]:
    """``(lanes, columns)`` of ``reduce_dweight``'s tile: ``reduce_tile`` with ``REDUCE_ROWS`` lanes, then at most
    ``REDUCE_WIDE_ROWS`` lanes where that tile has at least ``REDUCE_WIDE_COLS`` columns (its width unchanged)."""
    lanes, cols = reduce_tile(parts, n, sms, REDUCE_ROWS, REDUCE_COLS, REDUCE_MAX_COLS)
    return (min(lanes, REDUCE_WIDE_ROWS) if cols >= REDUCE_WIDE_COLS else lanes), cols


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
    (``_dweight_reduce_kernel``; the tile from ``jax_reduce_tile``)."""
    parts, n = partials.shape
    lanes, cols = jax_reduce_tile(parts, n, backend.num_sms())
    return pl.pallas_call(
        functools.partial(_dweight_reduce_kernel, n=n, parts=parts, lanes=lanes, cols=cols),
        out_shape=jax.ShapeDtypeStruct((n,), dtype), grid=(cdiv(n, cols),),
        compiler_params=backend.compiler_params(REDUCE_WARPS, interpret=interpret), interpret=interpret,
        name="pallas_norm_dweight_reduce",
    )(partials)
