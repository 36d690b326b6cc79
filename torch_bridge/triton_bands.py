"""The Triton reference's backward of long rows on column bands (``triton_config.Config.lag``): the design of
``pallas_norm/bands.py`` in plain Triton, so both stacks read x and dy from memory once at 262144+ columns.

One program per band of ``block_n`` columns of every row (a co-resident grid of ``cdiv(N, block_n)`` programs),
rows walked in blocks of ``block_m``: block ``t``'s band is loaded (kept in L2), its dweight terms accumulated and
each row's partial ``Σ g·x`` posted as float32 bits to ``slots[row, band]`` (filled with ``UNPOSTED`` per call);
block ``t - lag`` is then finished from its band read again and the sum of its rows' slots in band order. A program
that polls ``SPIN_LIMIT`` times without seeing a block's slots complete computes the missing partials itself (the
owners' code, the same bits) and never waits again. Compute is float32 (float64 inputs stay on the chunked path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pallas_norm.pallas_config import cdiv, next_pow2
from torch_bridge import custom_ops, triton_launch
from torch_bridge.triton_config import Config
from torch_bridge.triton_rowmath import CASTING_CODES, INTERPRET, _TL_DTYPES, _dx, _grad_n, _normalize, _to_dt, _w_eff

UNPOSTED = -1  # int32 bits of a slot not yet posted (0xFFFFFFFF: a NaN payload no float32 arithmetic produces)
SPIN_LIMIT = 1 << 14  # polls of a block's slots before a program stops waiting (milliseconds; never hit on a GPU)


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
def _band_partial(X, DY, W, rows, row_mask, cols, N, offset, BLOCK_N: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                  CASTING: tl.constexpr, DT: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """Each row's ``Σ g·x`` over the band ``cols`` (float32), read from memory."""
    mask = row_mask[:, None] & (cols[None, :] < N)
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    w_eff = tl.zeros([BLOCK_N], dtype=tl.float32)
    if HAS_WEIGHT:
        w_eff = _w_eff(tl.load(W + cols, mask=cols < N, other=0.0), offset, CASTING, DT, tl.float32, EMULATE_BF16)
    return _sum_gx(x, dy, w_eff, HAS_WEIGHT, CASTING, DT, EMULATE_BF16)


@triton.jit
def _bands_bwd_kernel(X, W, DY, DH, RSTD, DX, DW, SLOT, M, N, offset, spin_limit,
                      P: tl.constexpr, S: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      LAG: tl.constexpr, HAS_WEIGHT: tl.constexpr, NEED_DX: tl.constexpr, NEED_DW: tl.constexpr,
                      HAS_DH: tl.constexpr, CASTING: tl.constexpr, DT: tl.constexpr, WDT: tl.constexpr,
                      EMULATE_BF16: tl.constexpr):
    """Program ``pid`` owns columns ``[pid·BLOCK_N, (pid + 1)·BLOCK_N)`` of every row; ``S`` slots per row (``P``
    bands, padded to a power of two)."""
    CT: tl.constexpr = tl.float32
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w_eff = tl.zeros([BLOCK_N], dtype=CT)
    if HAS_WEIGHT:
        w_eff = _w_eff(tl.load(W + cols, mask=col_mask, other=0.0), offset, CASTING, DT, CT, EMULATE_BF16)
    dw = tl.zeros([BLOCK_N], dtype=CT)
    pcols = tl.arange(0, S)
    alone = 0
    for t in range(0, tl.cdiv(M, BLOCK_M) + LAG):
        rows = t * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(X + offs, mask=mask, other=0.0, eviction_policy="evict_last")
        dy = tl.load(DY + offs, mask=mask, other=0.0, eviction_policy="evict_last")
        if NEED_DX:  # block t - LAG: its slots (in flight during block t's math) and its band again (L2)
            rows_b = rows - LAG * BLOCK_M
            row_mask_b = (rows_b >= 0) & (rows_b < M)
            slot_mask = row_mask_b[:, None] & (pcols[None, :] < P)
            slot_ptr = SLOT + rows_b.to(tl.int64)[:, None] * S + pcols[None, :]
            posted = tl.load(slot_ptr, mask=slot_mask, other=0, volatile=True)
            offs_b = rows_b.to(tl.int64)[:, None] * N + cols[None, :]
            mask_b = row_mask_b[:, None] & col_mask[None, :]
            x_b = tl.load(X + offs_b, mask=mask_b, other=0.0, eviction_policy="evict_first").to(CT)
            dy_b = tl.load(DY + offs_b, mask=mask_b, other=0.0, eviction_policy="evict_first").to(CT)
            rstd_b = tl.load(RSTD + rows_b, mask=row_mask_b, other=0.0)
        x = x.to(CT)
        dy = dy.to(CT)
        if NEED_DW:
            rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
            dw += tl.sum(dy * _normalize(x, rstd, CASTING, DT, CT, EMULATE_BF16), axis=0)
        if NEED_DX:
            part = _sum_gx(x, dy, w_eff, HAS_WEIGHT, CASTING, DT, EMULATE_BF16)
            part = tl.where(part == part, part, float("nan"))  # one NaN pattern, never UNPOSTED
            tl.store(SLOT + rows.to(tl.int64) * S + pid, part.to(tl.int32, bitcast=True), mask=row_mask)
            ready = _complete(posted, slot_mask)
            spins = 0
            while (alone == 0) & (ready == 0) & (spins < spin_limit):
                posted = tl.load(slot_ptr, mask=slot_mask, other=0, volatile=True)
                ready = _complete(posted, slot_mask)
                spins += 1
            vals = posted.to(tl.float32, bitcast=True)
            if ready == 0:  # the missing partials, computed here (only their bands' rows are read)
                alone = 1
                missing = (posted == -1) & slot_mask
                for q in range(0, P):
                    hit = missing & (pcols[None, :] == q)
                    rows_q = tl.max(tl.where(hit, 1, 0), axis=1) == 1
                    q_part = _band_partial(X, DY, W, rows_b, rows_q, q * BLOCK_N + tl.arange(0, BLOCK_N), N, offset,
                                           BLOCK_N, HAS_WEIGHT, CASTING, DT, EMULATE_BF16)
                    vals = tl.where(hit, q_part[:, None], vals)
            c = tl.sum(tl.where(slot_mask, vals, 0.0), axis=1) / N
            dx = _dx(x_b, _grad_n(dy_b, w_eff, HAS_WEIGHT, CASTING, DT, CT, EMULATE_BF16), rstd_b, c)
            if HAS_DH:
                dx += tl.load(DH + offs_b, mask=mask_b, other=0.0).to(CT)
            tl.store(DX + offs_b, _to_dt(dx, DT, EMULATE_BF16), mask=mask_b)
    if NEED_DW:
        tl.store(DW + cols, _to_dt(dw, WDT, EMULATE_BF16), mask=col_mask)


def backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor, offset: float,
             casting: str, need_dx: bool, need_dweight: bool, cfg: Config, config_key: object,
             dh_out: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """As ``triton_kernels.rms_norm_bwd`` for a band config (``cfg.lag``, float32 compute): one launch; each band's
    dweight stored by its owner. ``config_key`` is what the caller passed as ``config`` (part of the launch key)."""
    M, N = custom_ops.rows(x)
    need_dweight = need_dweight and weight is not None
    has_dh = dh_out is not None and need_dx
    programs = cdiv(N, cfg.block_n)
    slots_per_row = next_pow2(programs)
    dx = torch.empty_like(x) if need_dx else None
    dweight = torch.empty_like(weight) if need_dweight else None
    slots = torch.full((M, slots_per_row), UNPOSTED, dtype=torch.int32, device=x.device) if need_dx else rstd
    key = ("bands", M, N, x.dtype, custom_ops.dtype_of(weight), offset, casting, config_key, x.get_device(),
           need_dx, need_dweight, has_dh)
    triton_launch.launch(key, _bands_bwd_kernel, (programs,),
                         (x, weight if weight is not None else x, dy, dh_out if has_dh else dy, rstd,
                          dx if need_dx else x, dweight if need_dweight else rstd, slots, M, N, offset,
                          0 if INTERPRET else SPIN_LIMIT),
                         lambda: dict(P=programs, S=slots_per_row, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                                      LAG=cfg.lag if need_dx else 0, HAS_WEIGHT=weight is not None, NEED_DX=need_dx,
                                      NEED_DW=need_dweight, HAS_DH=has_dh, CASTING=CASTING_CODES[casting],
                                      DT=_TL_DTYPES[x.dtype],
                                      WDT=_TL_DTYPES[weight.dtype] if need_dweight else tl.float32,
                                      EMULATE_BF16=INTERPRET, num_warps=cfg.num_warps),
                         interpret=INTERPRET)
    return dx, dweight
