"""One row block's steps in the Triton reference's band kernels (``triton_bands.py``): fetching a block's band,
starting it (its partial sums posted; the backward's dweight terms) and finishing it late (y, or dx, from the band read
again and the rows' totals). FULL: a walk of full blocks (``triton_bands._full``), the masks constant."""

from __future__ import annotations

import triton
import triton.language as tl

from torch_bridge.triton_band_slots import _band_rows, _post, _sum_gx, _sum_slots, _totals, _wait
from torch_bridge.triton_rowmath import _bwd_weight, _dx, _grad_n, _normalize, _rstd, _tile, _to_dt


@triton.jit
def _block(t, g, G: tl.constexpr, BLOCK_M: tl.constexpr, M, FULL: tl.constexpr = False):
    """Row group g's t-th row block (blocks g, g + G, ...): its rows and their mask (FULL: a full block, the mask
    constant)."""
    rows = (t * G + g) * BLOCK_M + tl.arange(0, BLOCK_M)
    return rows, tl.full([BLOCK_M], True, tl.int1) if FULL else rows < M


@triton.jit
def _own_band(W, pid, N, offset, BLOCK_N: tl.constexpr, HAS_WEIGHT: tl.constexpr, CASTING: tl.constexpr,
              DT: tl.constexpr, EMULATE_BF16: tl.constexpr, LOW: tl.constexpr = False, FULL: tl.constexpr = False):
    """Program ``pid``'s band: its columns, their mask and its effective weight (``_bwd_weight``: float32, zeros
    without; with LOW values of DT); FULL: every band full, the mask constant."""
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = tl.full([BLOCK_N], True, tl.int1) if FULL else cols < N
    return cols, col_mask, _bwd_weight(W, cols, col_mask, N, offset, HAS_WEIGHT, LOW, CASTING, DT, tl.float32,
                                       EMULATE_BF16)


@triton.jit
def _fwd_fetch(X, R, t, g, cols, col_mask, M, N, G: tl.constexpr, BLOCK_M: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
               DT: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """Block t's band of the forward's rows from memory, kept in L2 for the second read (``_band_rows``)."""
    rows, row_mask = _block(t, g, G, BLOCK_M, M)
    offs, mask = _tile(rows, row_mask, cols, col_mask, N)
    return _band_rows(X, R, offs, mask, HAS_RESIDUAL, DT, EMULATE_BF16, "evict_last")


@triton.jit
def _band_read(X, DY, RSTD, rows, row_mask, cols, col_mask, N, EVICT: tl.constexpr):
    """A row block's band of x and dy (L2 policy ``EVICT``) and its rows' rstd: ``(offs, mask, x, dy, rstd)``; the
    first read (``_bwd_fetch``) and, for block t - LAG, the second, to finish it."""
    offs, mask = _tile(rows, row_mask, cols, col_mask, N)
    return (offs, mask, tl.load(X + offs, mask=mask, other=0.0, eviction_policy=EVICT),
            tl.load(DY + offs, mask=mask, other=0.0, eviction_policy=EVICT),
            tl.load(RSTD + rows, mask=row_mask, other=0.0))


@triton.jit
def _bwd_fetch(X, DY, RSTD, t, g, cols, col_mask, M, N, G: tl.constexpr, BLOCK_M: tl.constexpr,
               FULL: tl.constexpr = False):
    """Block t's band of x and dy (kept in L2 for the second read) and its rows' rstd (``_band_read``)."""
    rows, row_mask = _block(t, g, G, BLOCK_M, M, FULL)
    _, _, x, dy, rstd = _band_read(X, DY, RSTD, rows, row_mask, cols, col_mask, N, "evict_last")
    return x, dy, rstd


@triton.jit
def _fwd_finish(X, R, W, Y, H, RSTD, SLOT, rows_b, row_mask_b, slot_mask, posted, alone, pcols, pid, x_b, offs_b,
                mask_b, w_eff, N, n_f, eps, offset, spin_limit, P: tl.constexpr, S: tl.constexpr, BLOCK_N: tl.constexpr,
                HAS_WEIGHT: tl.constexpr, HAS_RESIDUAL: tl.constexpr, CASTING: tl.constexpr, DT: tl.constexpr,
                EMULATE_BF16: tl.constexpr):
    """Block t - LAG's y (and h; band 0 its rstd) from its band ``x_b`` and its rows' totals (``_totals``); returns
    ``alone``."""
    CT: tl.constexpr = tl.float32
    total, alone = _totals(X, R, W, SLOT, rows_b, slot_mask, posted, alone, pcols, N, offset, spin_limit, P, S,
                           BLOCK_N, True, HAS_WEIGHT, HAS_RESIDUAL, CASTING, DT, EMULATE_BF16)
    rstd = _rstd(total, n_f, eps, CT)
    if HAS_RESIDUAL:
        tl.store(H + offs_b, _to_dt(x_b, DT, EMULATE_BF16), mask=mask_b)
    y = _normalize(x_b, rstd, CASTING, DT, CT, EMULATE_BF16)
    if HAS_WEIGHT:
        y = y * w_eff[None, :]
    tl.store(Y + offs_b, _to_dt(y, DT, EMULATE_BF16), mask=mask_b)
    tl.store(RSTD + rows_b, rstd, mask=row_mask_b & (pid == 0))
    return alone


@triton.jit
def _bwd_start(x, dy, rstd, dw, w_eff, SLOT, rows, row_mask, S, pid, HAS_WEIGHT: tl.constexpr, NEED_DX: tl.constexpr,
               NEED_DW: tl.constexpr, CASTING: tl.constexpr, DT: tl.constexpr, EMULATE_BF16: tl.constexpr,
               LOW: tl.constexpr):
    """Block t's band: its dweight terms added to ``dw`` (returned) and, with NEED_DX, its rows' ``Σ g·x`` posted
    (LOW: g = r(dy·w_eff) as one multiply in DT, the float32 product's bits)."""
    if NEED_DX and LOW:
        g = (dy * w_eff[None, :]).to(tl.float32)
    x = x.to(tl.float32)
    dy = dy.to(tl.float32)
    if NEED_DW:
        dw += tl.sum(dy * _normalize(x, rstd, CASTING, DT, tl.float32, EMULATE_BF16), axis=0)
    if NEED_DX:
        if LOW:
            _post(SLOT, rows, row_mask, S, pid, tl.sum(g * x, axis=1))
        else:
            _post(SLOT, rows, row_mask, S, pid, _sum_gx(x, dy, w_eff, HAS_WEIGHT, CASTING, DT, EMULATE_BF16))
    return dw


@triton.jit
def _bwd_finish(x_b, dy_b, rstd_b, total, w_eff, DH, DX, offs_b, mask_b, N, HAS_WEIGHT: tl.constexpr,
                HAS_DH: tl.constexpr, CASTING: tl.constexpr, DT: tl.constexpr, EMULATE_BF16: tl.constexpr,
                LOW: tl.constexpr):
    """Block t - LAG's band of dx from its band (x_b, dy_b, rstd_b) and its rows' totals (LOW: as ``_bwd_start``)."""
    CT: tl.constexpr = tl.float32
    if LOW:
        g = (dy_b * w_eff[None, :]).to(CT)
    else:
        g = _grad_n(dy_b.to(CT), w_eff, HAS_WEIGHT, CASTING, DT, CT, EMULATE_BF16)
    dx = _dx(x_b.to(CT), g, rstd_b, total / N)
    if HAS_DH:
        dx += tl.load(DH + offs_b, mask=mask_b, other=0.0).to(CT)
    tl.store(DX + offs_b, _to_dt(dx, DT, EMULATE_BF16), mask=mask_b)


@triton.jit
def _bwd_complete(t, stop, x_b, dy_b, rstd_b, w_eff, SLOT, DH, DX, rows_b, slot_mask, posted, pcols, offs_b, mask_b, N,
                  spin_limit, S: tl.constexpr, BLOCK_M: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_DH: tl.constexpr,
                  CASTING: tl.constexpr, DT: tl.constexpr, EMULATE_BF16: tl.constexpr, LOW: tl.constexpr):
    """Block t - LAG finished once its slots are all posted (``_wait``); returns ``stop``: ``t`` where the wait gave
    up (nothing written: the kernel's second loop finishes it)."""
    posted, ready = _wait(SLOT, rows_b, slot_mask, posted, pcols, spin_limit, S)
    if ready == 1:
        total = _sum_slots(posted.to(tl.float32, bitcast=True), slot_mask, BLOCK_M, S)
        _bwd_finish(x_b, dy_b, rstd_b, total, w_eff, DH, DX, offs_b, mask_b, N, HAS_WEIGHT, HAS_DH, CASTING, DT,
                    EMULATE_BF16, LOW)
    else:
        stop = t
    return stop
