"""The slot protocol of the Triton reference's band kernels (``triton_bands``), the counterpart of
``pallas_norm/band_slots.py``: each row's partial sum over a band posted as float32 bits to ``slots[row, band]``
(``-1``, ``UNPOSTED``, until then), read back ``lag`` blocks later, polled until complete, and summed; a program
that gives up waiting computes the missing partials itself from memory (the owners' code, the same bits).
"""

from __future__ import annotations

import triton
import triton.language as tl

from torch_bridge.triton_rowmath import _grad_n, _to_dt, _w_eff

UNPOSTED = -1  # int32 bits of a slot not yet posted (0xFFFFFFFF: a NaN payload no float32 arithmetic produces)


@triton.jit
def _sum_gx(x, dy, w_eff, HAS_WEIGHT: tl.constexpr, CASTING: tl.constexpr, DT: tl.constexpr,
            EMULATE_BF16: tl.constexpr):
    """Each row's ``Σ g·x`` over a band's float32 tile: the owner's post and the fallback's recompute (one code,
    the same bits)."""
    return tl.sum(_grad_n(dy, w_eff, HAS_WEIGHT, CASTING, DT, tl.float32, EMULATE_BF16) * x, axis=1)


@triton.jit
def _complete(posted, slot_mask):
    """1 when every live slot is posted (-1 is ``UNPOSTED``, the fill), else 0."""
    return tl.min(tl.min(tl.where((posted != -1) | ~slot_mask, 1, 0), axis=1), axis=0)


@triton.jit
def _band_rows(X, R, offs, mask, HAS_RESIDUAL: tl.constexpr, DT: tl.constexpr, EMULATE_BF16: tl.constexpr,
               EVICT: tl.constexpr):
    """The forward's band of rows in float32: x, or (the fused add) h = r(x + residual) (DT is h's dtype)."""
    x = tl.load(X + offs, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(R + offs, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
        x = _to_dt(x + r, DT, EMULATE_BF16).to(tl.float32)
    return x


@triton.jit
def _band_partial(X, B, W, rows, row_mask, cols, N, offset, BLOCK_N: tl.constexpr, FORWARD: tl.constexpr,
                  HAS_WEIGHT: tl.constexpr, HAS_RESIDUAL: tl.constexpr, CASTING: tl.constexpr, DT: tl.constexpr,
                  EMULATE_BF16: tl.constexpr):
    """Each row's partial sum over the band ``cols`` (float32), read from memory: the forward's ``Σ x²`` (``B``
    the residual, with ``HAS_RESIDUAL``), else ``Σ g·x`` (``B`` is dy)."""
    mask = row_mask[:, None] & (cols[None, :] < N)
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    if FORWARD:
        x = _band_rows(X, B, offs, mask, HAS_RESIDUAL, DT, EMULATE_BF16, "")
        return tl.sum(x * x, axis=1)
    else:
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
        w_eff = tl.zeros([BLOCK_N], dtype=tl.float32)
        if HAS_WEIGHT:
            w_eff = _w_eff(tl.load(W + cols, mask=cols < N, other=0.0), offset, CASTING, DT, tl.float32,
                           EMULATE_BF16)
        return _sum_gx(x, dy, w_eff, HAS_WEIGHT, CASTING, DT, EMULATE_BF16)


@triton.jit
def _post(SLOT, rows, row_mask, S, pid, part):
    """Post each row's partial (one NaN pattern, never ``UNPOSTED``) to its slot of band ``pid``."""
    part = tl.where(part == part, part, float("nan"))
    tl.store(SLOT + rows.to(tl.int64) * S + pid, part.to(tl.int32, bitcast=True), mask=row_mask)


@triton.jit
def _lagged(SLOT, rows, M, pcols, P: tl.constexpr, S: tl.constexpr, G: tl.constexpr, LAG: tl.constexpr,
            BLOCK_M: tl.constexpr, FULL: tl.constexpr = False):
    """The row block ``LAG`` steps behind ``rows``: ``(rows_b, row_mask_b, slot_mask, posted)``, its slots read
    (volatile) now, so they are in flight during the current block's math (FULL: a full block, the row mask
    constant)."""
    rows_b = rows - LAG * G * BLOCK_M
    row_mask_b = tl.full([BLOCK_M], True, tl.int1) if FULL else (rows_b >= 0) & (rows_b < M)
    slot_mask = row_mask_b[:, None] & (pcols[None, :] < P)
    posted = tl.load(SLOT + rows_b.to(tl.int64)[:, None] * S + pcols[None, :], mask=slot_mask, other=0, volatile=True)
    return rows_b, row_mask_b, slot_mask, posted


@triton.jit
def _sum_slots(vals, slot_mask, BLOCK_M: tl.constexpr, S: tl.constexpr):
    """Σ over each row's ``S`` slots (padding masked out) as one fixed pairwise tree, ((s0 + s1) + (s2 + s3)) + ...:
    every level adds pairs, so the bits do not depend on the layout Triton picks for ``vals``, which can differ
    between two call sites (``tl.sum`` adds each thread's elements first, then across threads)."""
    tl.static_assert(S < 1 << 16, "_sum_slots adds at most 15 levels")
    v = tl.where(slot_mask, vals, 0.0)
    for level in tl.static_range(1, 16):
        if (S >> level) >= 1:
            v = tl.sum(tl.reshape(v, [BLOCK_M, S >> level, 2]), axis=2)
    return tl.reshape(v, [BLOCK_M])


@triton.jit
def _wait(SLOT, rows_b, slot_mask, posted, pcols, spin_limit, S: tl.constexpr):
    """``(posted, ready)``: rows_b's slots polled until all are posted, at most ``spin_limit`` times."""
    slot_ptr = SLOT + rows_b.to(tl.int64)[:, None] * S + pcols[None, :]
    ready = _complete(posted, slot_mask)
    spins = 0
    while (ready == 0) & (spins < spin_limit):
        posted = tl.load(slot_ptr, mask=slot_mask, other=0, volatile=True)
        ready = _complete(posted, slot_mask)
        spins += 1
    return posted, ready


@triton.jit
def _fill_missing(X, B, W, rows_b, slot_mask, posted, pcols, N, offset, P: tl.constexpr, BLOCK_N: tl.constexpr,
                  FORWARD: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_RESIDUAL: tl.constexpr, CASTING: tl.constexpr,
                  DT: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """rows_b's slots as float32, the partials missing from ``posted`` computed here (only their bands' rows are
    read; the owners' code, the same bits)."""
    vals = posted.to(tl.float32, bitcast=True)
    missing = (posted == -1) & slot_mask
    for q in range(0, P):
        hit = missing & (pcols[None, :] == q)
        rows_q = tl.max(tl.where(hit, 1, 0), axis=1) == 1
        q_part = _band_partial(X, B, W, rows_b, rows_q, q * BLOCK_N + tl.arange(0, BLOCK_N), N, offset, BLOCK_N,
                               FORWARD, HAS_WEIGHT, HAS_RESIDUAL, CASTING, DT, EMULATE_BF16)
        vals = tl.where(hit, q_part[:, None], vals)
    return vals


@triton.jit
def _totals(X, B, W, SLOT, rows_b, slot_mask, posted, alone, pcols, N, offset, spin_limit, P: tl.constexpr,
            S: tl.constexpr, BLOCK_N: tl.constexpr, FORWARD: tl.constexpr, HAS_WEIGHT: tl.constexpr,
            HAS_RESIDUAL: tl.constexpr, CASTING: tl.constexpr, DT: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """``(Σ over bands of rows_b's slots, alone)``: polled until all are posted (at most ``spin_limit`` times, none
    once ``alone``), else the missing partials computed here and ``alone`` set. One ``tl.sum`` for both cases, so one
    summation order (the forward's; the backward's two loops sum with ``_sum_slots``)."""
    posted, ready = _wait(SLOT, rows_b, slot_mask, posted, pcols, spin_limit * (1 - alone), S)
    vals = posted.to(tl.float32, bitcast=True)
    if ready == 0:
        alone = 1
        vals = _fill_missing(X, B, W, rows_b, slot_mask, posted, pcols, N, offset, P, BLOCK_N, FORWARD, HAS_WEIGHT,
                             HAS_RESIDUAL, CASTING, DT, EMULATE_BF16)
    return tl.sum(tl.where(slot_mask, vals, 0.0), axis=1), alone

