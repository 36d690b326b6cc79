"""The fixed-order sum of float32 dweight partials (one row per program or row group) for the Triton reference's
backward kernels (``triton_kernels``' persistent grid, ``triton_bands``' row groups)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pallas_norm.dweight import reduce_tile
from pallas_norm.pallas_config import cdiv
from torch_bridge import triton_launch
from torch_bridge.triton_rowmath import INTERPRET, _TL_DTYPES, _to_dt

# The reduction's tile (partial rows × columns per program) and warps. Its loop is a chain of loads (Triton
# pipelines only loads that feed a dot), so the rows per step set its speed. H100, kernel durations (fourteenth
# session, bench/results/dweight_reduce_h100.md): 64 × 64 on 4 warps → 256 × 32 on 8: 132 partial rows 2.7 → 1.9 µs,
# 264 (the resident backward's grid) 4.0 → 2.7, 528 × 4096 10.8 → 4.8; fewer partial rows (the bands' row groups)
# take fewer rows and wider tiles (pallas_norm.dweight.reduce_tile): 4 rows of 262144 columns 8.1 → 6.6 µs. Short
# rows take narrower tiles, about one program per SM (pallas_norm.dweight.reduce_cols; sixteenth session, kernel
# durations: the backward of 4096×1024 2.23 → 2.36 TB/s, 264 partial rows of 1024 columns 2.86 → 2.27 µs).
REDUCE_BLOCK_G, REDUCE_BLOCK_N, REDUCE_WARPS = 256, 32, 8
REDUCE_MAX_N = 256  # fewer partial rows take wider tiles up to this (pallas_norm.dweight.reduce_tile)


@triton.jit
def _dweight_reduce_kernel(DWP, DW, G, N, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, CT: tl.constexpr,
                           WDT: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """dweight[cols] = the sum over p < G of DWP[p, cols] (CT), stored as WDT: tiles of BLOCK_G partial rows,
    each summed by ``tl.sum``, added in row order; the same order on every call, so the bits repeat."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    acc = tl.zeros([BLOCK_N], dtype=CT)
    for start in range(0, G, BLOCK_G):
        rows = start + tl.arange(0, BLOCK_G)
        mask = (rows < G)[:, None] & col_mask[None, :]
        acc += tl.sum(tl.load(DWP + rows.to(tl.int64)[:, None] * N + cols[None, :], mask=mask, other=0.0), axis=0)
    tl.store(DW + cols, _to_dt(acc, WDT, EMULATE_BF16), mask=col_mask)


_tile = functools.lru_cache(maxsize=None)(reduce_tile)  # once per shape: ``reduce`` runs on every backward


def reduce(partials: torch.Tensor, dweight: torch.Tensor, key: tuple) -> None:
    """``dweight[:] = Σ_p partials[p, :]`` (rows of the compute dtype, summed in row order), in one launch (not
    torch's sum and cast: two ops, ~2× the host time); ``key`` names the launch (``triton_launch.launch``)."""
    g, n = partials.shape
    block_g, block_n = _tile(g, n, triton_launch.sm_count(partials), REDUCE_BLOCK_G, REDUCE_BLOCK_N, REDUCE_MAX_N)
    triton_launch.launch(key, _dweight_reduce_kernel, (cdiv(n, block_n),), (partials, dweight, g, n),
                         lambda: dict(BLOCK_G=block_g, BLOCK_N=block_n, CT=_TL_DTYPES[partials.dtype],
                                      WDT=_TL_DTYPES[dweight.dtype], EMULATE_BF16=INTERPRET, num_warps=REDUCE_WARPS),
                         interpret=INTERPRET)
