"""The Triton reference's resident backward on rows held as their two power-of-two pieces (``triton_config.Config``'s
``pieces``; the Pallas kernels' design, ``pallas_config.BWD_PIECES``): a row of 2304 columns is the tiles 2048 + 256
instead of one tile of 4096 with 1792 masked lanes. The row math is ``triton_rowmath``'s, per piece:

    c       = (sum(g·x32 over piece 0) + sum(g·x32 over piece 1)) / N
    dx      = r(rstd · (g − x32 · rstd² · c))      (+ dh_out for the fused add)
    dweight = Σ rows dy · n, per column as the padded kernel adds it (the same partials on the same grid)

The grid, the partials and their reduction are ``triton_kernels.rms_norm_bwd``'s, which launches this kernel.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from pallas_norm.pallas_config import pieces_of
from torch_bridge.triton_rowmath import _dx, _grad_n, _normalize, _tile, _to_dt, _w_eff


@functools.cache  # asked on every backward launch of such rows
def two_pieces(n: int) -> tuple[int, int]:
    """``(P0, P1)``: the two power-of-two pieces of a row of ``n`` columns, largest first; a ValueError for rows
    that are not two pieces (a power of two is one: the padded kernel holds it without masked lanes)."""
    pieces = pieces_of(n)
    if len(pieces) != 2:
        raise ValueError(f"pieces holds rows of two power-of-two pieces (2304 = 2048 + 256), got {n} columns "
                         f"({' + '.join(map(str, pieces))})")
    return pieces[0], pieces[1]


@triton.jit
def _piece(rows, row_mask, START: tl.constexpr, SIZE: tl.constexpr, N):
    """The offsets and mask of columns START … START + SIZE of row block ``rows`` (rows only: the piece is inside
    the row)."""
    return _tile(rows, row_mask, START + tl.arange(0, SIZE), tl.full([SIZE], True, tl.int1), N)


@triton.jit
def _load(X, DY, DH, rows, row_mask, START: tl.constexpr, SIZE: tl.constexpr, N, HAS_DH: tl.constexpr):
    """One piece of row block ``rows``: raw x, dy and (HAS_DH) dh_out, loaded together (dh_out's latency hidden with
    theirs; 0 without it)."""
    offs, mask = _piece(rows, row_mask, START, SIZE, N)
    dh = 0.0
    if HAS_DH:
        dh = tl.load(DH + offs, mask=mask, other=0.0)
    return tl.load(X + offs, mask=mask, other=0.0), tl.load(DY + offs, mask=mask, other=0.0), dh


@triton.jit
def _block(X, DY, DH, RSTD, rows, M, N, P0: tl.constexpr, P1: tl.constexpr, HAS_DH: tl.constexpr):
    """Row block ``rows``' raw x, dy and dh_out, piece by piece, and rstd (rows past M read zeros).

    The small piece is loaded first. Triton 3.6's layout pass gives the row sum ``c`` the layout of the piece loaded
    last; for Gemma's unrounded g it then carried that layout back onto the other piece. Large piece first, Gemma's
    kernel converted the 2048 columns of x and g between layouts through shared memory every row (26 barriers against
    Llama's 14 at 2304, sm_90); small piece first, the 256 columns (15 barriers). Fifty-first session (H200,
    bf16, the heuristic's tiles, kernels timed over rotated inputs, two rounds, the slower quoted;
    probes_h200_2026-11-29_fiftyfirst.md §2), TB/s at 4096 / 32768 rows, Gemma plain 2304 2.88 / 3.85 → 3.00 /
    3.95, fused add 2304 2.98 / 3.92 → 3.13 / 4.08, 2560 3.06 / 4.00 → 3.19 / 4.09, 5120 3.35 / 3.92 → 3.50 / 4.07
    (plain 2560 and 5120 level); Llama level but plain 5120 3.35 / 3.99 → 3.41 / 4.06 and 4096×2560 2.88 → 2.84.
    dweight keeps its bits; Gemma's dx changes bits where c's summation order changed (the 2048 piece now sums in its
    own layout, as Llama's does).
    """
    row_mask = rows < M
    xb, dyb, dhb = _load(X, DY, DH, rows, row_mask, P0, P1, N, HAS_DH)
    xa, dya, dha = _load(X, DY, DH, rows, row_mask, 0, P0, N, HAS_DH)
    return xa, dya, dha, xb, dyb, dhb, tl.load(RSTD + rows, mask=row_mask, other=0.0)


@triton.jit
def _store_dx(DX, rows, row_mask, START: tl.constexpr, SIZE: tl.constexpr, N, x, g, rstd, c, dh,
              HAS_DH: tl.constexpr, DT: tl.constexpr, CT: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """dx over one piece (``_dx``; with HAS_DH plus dh_out), stored as DT."""
    offs, mask = _piece(rows, row_mask, START, SIZE, N)
    dx = _dx(x, g, rstd, c)
    if HAS_DH:
        dx += dh.to(CT)
    tl.store(DX + offs, _to_dt(dx, DT, EMULATE_BF16), mask=mask)


@triton.jit
def _store_dw(DWP, pid, START: tl.constexpr, SIZE: tl.constexpr, N, acc, DW_DIRECT: tl.constexpr, WDT: tl.constexpr,
              EMULATE_BF16: tl.constexpr):
    """One piece of the program's dweight partial (DWP[pid]), or of dweight itself with DW_DIRECT (one program)."""
    cols = START + tl.arange(0, SIZE)
    if DW_DIRECT:
        tl.store(DWP + cols, _to_dt(tl.sum(acc, axis=0), WDT, EMULATE_BF16))
    else:
        tl.store(DWP + pid.to(tl.int64) * N + cols, tl.sum(acc, axis=0))


@triton.jit
def bwd_pieces_kernel(X, W, DY, DH, RSTD, C, DX, DWP, M, N, G, ITERS, offset,
                      BLOCK_M: tl.constexpr, P0: tl.constexpr, P1: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                      NEED_DX: tl.constexpr, NEED_DW: tl.constexpr, HAS_DH: tl.constexpr, DW_DIRECT: tl.constexpr,
                      PREFETCH: tl.constexpr, CASTING: tl.constexpr, DT: tl.constexpr, CT: tl.constexpr,
                      WDT: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """``triton_kernels._bwd_kernel``'s persistent grid (program p walks row blocks p, p + G, ...) on rows of
    N = P0 + P1 columns held as the two pieces (C unused: the row sum is computed here); HAS_DH (the fused add's
    backward) reads dh_out with x and dy. PREFETCH: the next row block's pieces and rstd are loaded before the current
    one's math (the same values, the same bits)."""
    pid = tl.program_id(0)
    wa = tl.zeros([P0], dtype=CT)
    wb = tl.zeros([P1], dtype=CT)
    if HAS_WEIGHT:
        wa = _w_eff(tl.load(W + tl.arange(0, P0)), offset, CASTING, DT, CT, EMULATE_BF16)
        wb = _w_eff(tl.load(W + P0 + tl.arange(0, P1)), offset, CASTING, DT, CT, EMULATE_BF16)
    dwa = tl.zeros([BLOCK_M, P0], dtype=CT)
    dwb = tl.zeros([BLOCK_M, P1], dtype=CT)
    if PREFETCH:
        nxt = _block(X, DY, DH, RSTD, pid * BLOCK_M + tl.arange(0, BLOCK_M), M, N, P0, P1, HAS_DH)
    for it in range(0, ITERS):
        rows = (it * G + pid) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        if PREFETCH:
            xa, dya, dha, xb, dyb, dhb, rstd = nxt
            nxt = _block(X, DY, DH, RSTD, rows + G * BLOCK_M, M, N, P0, P1, HAS_DH)
        else:
            xa, dya, dha, xb, dyb, dhb, rstd = _block(X, DY, DH, RSTD, rows, M, N, P0, P1, HAS_DH)
        xa = xa.to(CT)
        xb = xb.to(CT)
        dya = dya.to(CT)
        dyb = dyb.to(CT)
        if NEED_DX:
            ga = _grad_n(dya, wa, HAS_WEIGHT, CASTING, DT, CT, EMULATE_BF16)
            gb = _grad_n(dyb, wb, HAS_WEIGHT, CASTING, DT, CT, EMULATE_BF16)
            c = (tl.sum(ga * xa, axis=1) + tl.sum(gb * xb, axis=1)) / N
            _store_dx(DX, rows, row_mask, 0, P0, N, xa, ga, rstd, c, dha, HAS_DH, DT, CT, EMULATE_BF16)
            _store_dx(DX, rows, row_mask, P0, P1, N, xb, gb, rstd, c, dhb, HAS_DH, DT, CT, EMULATE_BF16)
        if NEED_DW:
            dwa += dya * _normalize(xa, rstd, CASTING, DT, CT, EMULATE_BF16)
            dwb += dyb * _normalize(xb, rstd, CASTING, DT, CT, EMULATE_BF16)
    if NEED_DW:
        _store_dw(DWP, pid, 0, P0, N, dwa, DW_DIRECT, WDT, EMULATE_BF16)
        _store_dw(DWP, pid, P0, P1, N, dwb, DW_DIRECT, WDT, EMULATE_BF16)
