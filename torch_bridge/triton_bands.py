"""The Triton reference on column bands of long rows (``triton_config.Config.lag``): the design of
``pallas_norm/bands.py`` in plain Triton, so both stacks read each row operand from memory once on long rows.

One program per band of ``block_n`` columns of every row (a co-resident grid of ``cdiv(N, block_n)`` programs),
rows walked in blocks of ``block_m``: block ``t``'s band is loaded (kept in L2) and each row's partial sum over the
band posted as float32 bits to ``slots[row, band]`` (filled with ``UNPOSTED`` per call): the forward's ``Σ x²``
(``Σ h²`` for the fused add), the backward's ``Σ g·x`` (the backward also accumulates its band's dweight); block
``t - lag`` is then finished from its band read again and the sum of its rows' slots (one order for every program):
y (and rstd, band 0) or dx. A program that polls ``SPIN_LIMIT`` times without seeing a block's slots complete
computes the missing partials itself (the owners' code, the same bits) and never waits again (the slot protocol:
``triton_band_slots``). Compute is float32 (float64 inputs stay on the chunked paths). A block's steps (fetch, start,
finish): ``triton_band_steps``. Where every block and band is full (``_full``) the plain backward walks in three
loops with constant masks (unmasked loads and stores; the same bits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pallas_norm import band_tables
from pallas_norm.band_slots import slot_width
from pallas_norm.pallas_config import cdiv
from torch_bridge import custom_ops, triton_dweight, triton_launch
from torch_bridge.triton_band_slots import UNPOSTED, _band_rows, _fill_missing, _lagged, _post, _sum_slots
from torch_bridge.triton_band_steps import (_band_read, _block, _bwd_complete, _bwd_fetch, _bwd_finish, _bwd_start,
                                            _fwd_fetch, _fwd_finish, _own_band)
from torch_bridge.triton_config import Config
from torch_bridge.triton_rowmath import CASTING_CODES, INTERPRET, _TL_DTYPES, _tile, _to_dt

SPIN_LIMIT = 1 << 14  # polls of a block's slots before a program stops waiting (milliseconds; never hit on a GPU)


@triton.jit
def _bands_fwd_kernel(X, R, W, Y, H, RSTD, SLOT, M, N, n_f, eps, offset, spin_limit,
                      P: tl.constexpr, S: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      LAG: tl.constexpr, PREFETCH: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                      HAS_RESIDUAL: tl.constexpr, CASTING: tl.constexpr, DT: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """Program ``(pid, g)`` owns columns ``[pid·BLOCK_N, (pid + 1)·BLOCK_N)`` of row group g's blocks (g, g + G,
    ...): posts block t's ``Σ x²`` (``Σ h²``), then writes block t - LAG's y (and h; band 0 its rstd). PREFETCH:
    block t + 1's band is loaded before block t's math (in flight meanwhile; the same values, the same bits). No walk
    of full blocks here (``_full``: it lost 16-20% on the H200)."""
    pid = tl.program_id(0)
    cols, col_mask, w_eff = _own_band(W, pid, N, offset, BLOCK_N, HAS_WEIGHT, CASTING, DT, EMULATE_BF16)
    pcols = tl.arange(0, S)
    g = tl.program_id(1)
    alone = 0
    if PREFETCH:
        x_next = _fwd_fetch(X, R, 0, g, cols, col_mask, M, N, G, BLOCK_M, HAS_RESIDUAL, DT, EMULATE_BF16)
    for t in range(0, tl.cdiv(tl.cdiv(M, BLOCK_M), G) + LAG):
        rows, row_mask = _block(t, g, G, BLOCK_M, M)
        if PREFETCH:
            x = x_next
            x_next = _fwd_fetch(X, R, t + 1, g, cols, col_mask, M, N, G, BLOCK_M, HAS_RESIDUAL, DT, EMULATE_BF16)
        else:
            x = _fwd_fetch(X, R, t, g, cols, col_mask, M, N, G, BLOCK_M, HAS_RESIDUAL, DT, EMULATE_BF16)
        # block t - LAG: its slots and its band again (L2), in flight meanwhile
        rows_b, row_mask_b, slot_mask, posted = _lagged(SLOT, rows, M, pcols, P, S, G, LAG, BLOCK_M)
        offs_b, mask_b = _tile(rows_b, row_mask_b, cols, col_mask, N)
        x_b = _band_rows(X, R, offs_b, mask_b, HAS_RESIDUAL, DT, EMULATE_BF16, "evict_first")
        _post(SLOT, rows, row_mask, S, pid, tl.sum(x * x, axis=1))
        alone = _fwd_finish(X, R, W, Y, H, RSTD, SLOT, rows_b, row_mask_b, slot_mask, posted, alone, pcols, pid,
                            x_b, offs_b, mask_b, w_eff, N, n_f, eps, offset, spin_limit, P, S, BLOCK_N, HAS_WEIGHT,
                            HAS_RESIDUAL, CASTING, DT, EMULATE_BF16)


@triton.jit
def _bands_bwd_kernel(X, W, DY, DH, RSTD, DX, DW, SLOT, M, N, offset, spin_limit,
                      P: tl.constexpr, S: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      LAG: tl.constexpr, PREFETCH: tl.constexpr, HAS_WEIGHT: tl.constexpr, NEED_DX: tl.constexpr,
                      NEED_DW: tl.constexpr, HAS_DH: tl.constexpr, CASTING: tl.constexpr, DT: tl.constexpr,
                      WDT: tl.constexpr, EMULATE_BF16: tl.constexpr, LOW: tl.constexpr, FULL: tl.constexpr):
    """Program ``(pid, g)`` owns columns ``[pid·BLOCK_N, (pid + 1)·BLOCK_N)`` of row group g's blocks (g, g + G,
    ...); ``S`` slots per row (``P`` bands, padded: ``pallas_norm.band_slots.slot_width``). With ``G`` > 1 ``DW`` holds
    float32 partials, one row per group. PREFETCH: block t + 1's band of x and dy and its rstd are loaded before
    block t's math (in flight meanwhile; the same values, the same bits). LOW (``triton_product.grad_in_dtype``:
    dy and w_eff both values of DT): g = r(dy·w_eff) as one multiply in DT, the float32 product's bits, w_eff held as
    DT (the Pallas band backward's ``low``: the band backward is bound by its instruction stream). FULL (``_full``:
    every block and band full, prefetching, LAG > 0): the first loop runs as three (the first LAG blocks started; block
    t started and block t - LAG finished; the last LAG finished), the masks constant (unmasked loads and stores).

    Two loops, so that the hot one holds no registers for computing a peer's partial (the fallback inside it spilled
    with PREFETCH and cost bf16 16-19%): the first waits for each block's slots, and a program that polls
    ``spin_limit`` times in vain stops there (``stop``: block ``stop`` started, block ``stop - LAG`` not finished);
    the second, run only by such a program, finishes the rest without waiting, computing the missing partials itself
    (``_fill_missing``). dweight adds the blocks in order either way; both loops sum the slots with ``_sum_slots``,
    whose order does not depend on the layout Triton gives each loop's slots (``tl.sum``'s does, and did: the two
    loops' dx differed in ~100 elements per 2^28)."""
    pid = tl.program_id(0)
    cols, col_mask, w_eff = _own_band(W, pid, N, offset, BLOCK_N, HAS_WEIGHT, CASTING, DT, EMULATE_BF16, LOW, FULL)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    pcols = tl.arange(0, S)
    g = tl.program_id(1)
    steps = tl.cdiv(tl.cdiv(M, BLOCK_M), G) + LAG
    stop = steps
    if PREFETCH:
        x_next, dy_next, rstd_next = _bwd_fetch(X, DY, RSTD, 0, g, cols, col_mask, M, N, G, BLOCK_M, FULL)
    if FULL:  # every block and band full, prefetching, LAG > 0 (``_full``): three loops, the masks constant
        for t in range(0, LAG):  # blocks 0 .. LAG - 1 started, nothing to finish yet
            rows, row_mask = _block(t, g, G, BLOCK_M, M, True)
            x, dy, rstd = x_next, dy_next, rstd_next
            x_next, dy_next, rstd_next = _bwd_fetch(X, DY, RSTD, t + 1, g, cols, col_mask, M, N, G, BLOCK_M, True)
            dw = _bwd_start(x, dy, rstd, dw, w_eff, SLOT, rows, row_mask, S, pid, HAS_WEIGHT, NEED_DX, NEED_DW,
                            CASTING, DT, EMULATE_BF16, LOW)
        for t in range(LAG, steps - LAG):  # block t started, block t - LAG finished
            if stop == steps:
                rows, row_mask = _block(t, g, G, BLOCK_M, M, True)
                x, dy, rstd = x_next, dy_next, rstd_next  # the last block's next: the last again (read, not used)
                x_next, dy_next, rstd_next = _bwd_fetch(X, DY, RSTD, tl.minimum(t + 1, steps - LAG - 1), g, cols,
                                                        col_mask, M, N, G, BLOCK_M, True)
                rows_b, row_mask_b, slot_mask, posted = _lagged(SLOT, rows, M, pcols, P, S, G, LAG, BLOCK_M, True)
                offs_b, mask_b, x_b, dy_b, rstd_b = _band_read(X, DY, RSTD, rows_b, row_mask_b, cols, col_mask, N,
                                                                "evict_first")
                dw = _bwd_start(x, dy, rstd, dw, w_eff, SLOT, rows, row_mask, S, pid, HAS_WEIGHT, NEED_DX, NEED_DW,
                                CASTING, DT, EMULATE_BF16, LOW)
                stop = _bwd_complete(t, stop, x_b, dy_b, rstd_b, w_eff, SLOT, DH, DX, rows_b, slot_mask, posted, pcols,
                                     offs_b, mask_b, N, spin_limit, S, BLOCK_M, HAS_WEIGHT, HAS_DH, CASTING, DT,
                                     EMULATE_BF16, LOW)
        # w_eff loaded again (as before the second loop below; the fused add's, which ``_full`` no longer gives this
        # walk, failed to compile otherwise)
        cols, col_mask, w_eff = _own_band(W, pid, N, offset, BLOCK_N, HAS_WEIGHT, CASTING, DT, EMULATE_BF16, LOW, True)
        for t in range(steps - LAG, steps):  # the last LAG blocks finished
            if stop == steps:
                rows, row_mask = _block(t, g, G, BLOCK_M, M, True)
                rows_b, row_mask_b, slot_mask, posted = _lagged(SLOT, rows, M, pcols, P, S, G, LAG, BLOCK_M, True)
                offs_b, mask_b, x_b, dy_b, rstd_b = _band_read(X, DY, RSTD, rows_b, row_mask_b, cols, col_mask, N,
                                                                "evict_first")
                stop = _bwd_complete(t, stop, x_b, dy_b, rstd_b, w_eff, SLOT, DH, DX, rows_b, slot_mask, posted, pcols,
                                     offs_b, mask_b, N, spin_limit, S, BLOCK_M, HAS_WEIGHT, HAS_DH, CASTING, DT,
                                     EMULATE_BF16, LOW)
    else:
        for t in range(0, steps):
            if stop == steps:
                rows, row_mask = _block(t, g, G, BLOCK_M, M)
                if PREFETCH:
                    x, dy, rstd = x_next, dy_next, rstd_next
                    x_next, dy_next, rstd_next = _bwd_fetch(X, DY, RSTD, t + 1, g, cols, col_mask, M, N, G, BLOCK_M)
                else:
                    x, dy, rstd = _bwd_fetch(X, DY, RSTD, t, g, cols, col_mask, M, N, G, BLOCK_M)
                if NEED_DX:  # block t - LAG: its slots and its band again (L2), in flight during block t's math
                    rows_b, row_mask_b, slot_mask, posted = _lagged(SLOT, rows, M, pcols, P, S, G, LAG, BLOCK_M)
                    offs_b, mask_b, x_b, dy_b, rstd_b = _band_read(X, DY, RSTD, rows_b, row_mask_b, cols, col_mask, N,
                                                                    "evict_first")
                dw = _bwd_start(x, dy, rstd, dw, w_eff, SLOT, rows, row_mask, S, pid, HAS_WEIGHT, NEED_DX, NEED_DW,
                                CASTING, DT, EMULATE_BF16, LOW)
                if NEED_DX:
                    stop = _bwd_complete(t, stop, x_b, dy_b, rstd_b, w_eff, SLOT, DH, DX, rows_b, slot_mask, posted,
                                         pcols, offs_b, mask_b, N, spin_limit, S, BLOCK_M, HAS_WEIGHT, HAS_DH, CASTING,
                                         DT, EMULATE_BF16, LOW)
    if NEED_DX:
        # w_eff loaded again: Triton 3.6 CSEs the hot loop's ``w_eff[None, :]`` into this loop otherwise (a use its
        # definition does not dominate; TritonGPURemoveLayoutConversions fails)
        cols, col_mask, w_eff = _own_band(W, pid, N, offset, BLOCK_N, HAS_WEIGHT, CASTING, DT, EMULATE_BF16, LOW)
        for t in range(stop, steps):  # only after giving up: nothing waits any more
            rows, row_mask = _block(t, g, G, BLOCK_M, M)
            if t > stop:
                x, dy, rstd = _bwd_fetch(X, DY, RSTD, t, g, cols, col_mask, M, N, G, BLOCK_M)
                dw = _bwd_start(x, dy, rstd, dw, w_eff, SLOT, rows, row_mask, S, pid, HAS_WEIGHT, NEED_DX, NEED_DW,
                                CASTING, DT, EMULATE_BF16, LOW)
            rows_b, row_mask_b, slot_mask, posted = _lagged(SLOT, rows, M, pcols, P, S, G, LAG, BLOCK_M)
            vals = _fill_missing(X, DY, W, rows_b, slot_mask, posted, pcols, N, offset, P, BLOCK_N, False, HAS_WEIGHT,
                                 False, CASTING, DT, EMULATE_BF16)
            total = _sum_slots(vals, slot_mask, BLOCK_M, S)
            offs_b, mask_b, x_b, dy_b, rstd_b = _band_read(X, DY, RSTD, rows_b, row_mask_b, cols, col_mask, N, "")
            _bwd_finish(x_b, dy_b, rstd_b, total, w_eff, DH, DX, offs_b, mask_b, N, HAS_WEIGHT, HAS_DH, CASTING, DT,
                        EMULATE_BF16, LOW)
    if NEED_DW and G == 1:
        tl.store(DW + cols, _to_dt(dw, WDT, EMULATE_BF16), mask=col_mask)
    elif NEED_DW:
        tl.store(DW + g.to(tl.int64) * N + cols, dw, mask=col_mask)


def _slots(M: int, width: int, device: torch.device) -> torch.Tensor:
    return torch.full((M, width), UNPOSTED, dtype=torch.int32, device=device)


def _groups(M: int, cfg: Config) -> int:
    """Row groups launched: the config's, at most one per row block."""
    return max(1, min(cfg.groups, cdiv(M, cfg.block_m)))


def _full(M: int, N: int, cfg: Config, groups: int, lag: int, has_dh: bool) -> bool:
    """Whether the backward walks full blocks with constant masks (FULL): ``band_tables.full_blocks`` (the Pallas
    kernels' ``bands._full_walk``), prefetching, with some lag and more blocks per row group than the lag; not the
    fused add's (``has_dh``). H200, bf16, launched by torch at 8192×32768-1024×262144 (fifty-fifth session): the plain
    backward +1.0% to +3.8%; the fused add's Llama +1.0% to +1.7% but Gemma -1.8% to -10.3% (245 registers against
    220, both within the 8 one-warp programs per SM; not understood); the forward (not kept) lost 16-20%: its walk
    took 191 registers against the masked walk's 126 (offline, sm_90, 4096×65536), so 10 of the 16 one-warp programs
    per SM its grid asks for fit at once, the rest waiting for a second wave (capped at 128, it spills)."""
    return (not has_dh and band_tables.walks_full_blocks(cdiv(M, cfg.block_m) // groups, lag, cfg.prefetch)
            and band_tables.full_blocks(M, N, cfg.block_m, cfg.block_n, groups))


def forward(x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, casting: str, cfg: Config,
            config_key: object, rstd: torch.Tensor, residual: torch.Tensor | None = None,
            h_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, ...]:
    """As ``triton_kernels.rms_norm_fwd`` for a band config (``cfg.lag``, float32 compute; a forward finishes at
    least one block late): one launch, rstd (written into ``rstd``) stored by band 0's program."""
    M, N = custom_ops.rows(x)
    fused = residual is not None
    programs, groups = cdiv(N, cfg.block_n), _groups(M, cfg)
    width = slot_width(programs, cfg.block_m, cfg.num_warps)  # at least 4 slots per thread (band_slots.slot_width)
    y = torch.empty_like(x, dtype=h_dtype if fused else None)
    h = torch.empty_like(x, dtype=h_dtype) if fused else None
    key = ("bands_fwd", M, N, x.dtype, custom_ops.dtype_of(weight), eps, offset, casting, config_key, x.get_device(),
           custom_ops.dtype_of(residual), h_dtype)
    triton_launch.launch(key, _bands_fwd_kernel, (programs, groups),
                         (x, residual if fused else x, weight if weight is not None else x, y, h if fused else y, rstd,
                          _slots(M, width, x.device), M, N, float(N), eps, offset, 0 if INTERPRET else SPIN_LIMIT),
                         lambda: dict(P=programs, S=width, G=groups, BLOCK_M=cfg.block_m,
                                      BLOCK_N=cfg.block_n, LAG=max(cfg.lag, 1), PREFETCH=cfg.prefetch,
                                      HAS_WEIGHT=weight is not None,
                                      HAS_RESIDUAL=fused, CASTING=CASTING_CODES[casting], DT=_TL_DTYPES[y.dtype],
                                      EMULATE_BF16=INTERPRET, num_warps=cfg.num_warps),
                         interpret=INTERPRET)
    return (y, h, rstd) if fused else (y, rstd)


def backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor, offset: float,
             casting: str, need_dx: bool, need_dweight: bool, cfg: Config, config_key: object,
             dh_out: torch.Tensor | None = None, low: bool = False
             ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """As ``triton_kernels.rms_norm_bwd`` for a band config (``cfg.lag``, float32 compute): one launch; each band's
    dweight stored by its owner (one row group), or its groups' float32 partials summed in group order (a second
    launch). ``config_key`` is what the caller passed as ``config`` (part of the launch key, which with it determines
    ``low``: the caller's ``triton_product.grad_in_dtype``, g = r(dy·w_eff) one multiply in x's dtype, LOW; taken by
    ``rms_norm``'s bf16 backward: H200 +2.8-5.6%, not the fused add's, -2.1% to +3.1%, nor fp16's, -16% at
    8192×32768; fifty-third session)."""
    M, N = custom_ops.rows(x)
    need_dweight = need_dweight and weight is not None
    has_dh = dh_out is not None and need_dx
    programs, groups = cdiv(N, cfg.block_n), _groups(M, cfg)
    width = slot_width(programs, cfg.block_m, cfg.num_warps)  # at least 4 slots per thread (band_slots.slot_width)
    dx = torch.empty_like(x) if need_dx else None
    dweight = torch.empty_like(weight) if need_dweight else None
    partials = x.new_empty((groups, N), dtype=torch.float32) if need_dweight and groups > 1 else dweight
    slots = _slots(M, width, x.device) if need_dx else rstd
    key = ("bands", M, N, x.dtype, custom_ops.dtype_of(weight), offset, casting, config_key, x.get_device(),
           need_dx, need_dweight, has_dh)
    triton_launch.launch(key, _bands_bwd_kernel, (programs, groups),
                         (x, weight if weight is not None else x, dy, dh_out if has_dh else dy, rstd,
                          dx if need_dx else x, partials if need_dweight else rstd, slots, M, N, offset,
                          0 if INTERPRET else SPIN_LIMIT),
                         lambda: dict(P=programs, S=width, G=groups, BLOCK_M=cfg.block_m,
                                      BLOCK_N=cfg.block_n, LAG=cfg.lag if need_dx else 0, PREFETCH=cfg.prefetch,
                                      HAS_WEIGHT=weight is not None,
                                      NEED_DX=need_dx, NEED_DW=need_dweight, HAS_DH=has_dh,
                                      CASTING=CASTING_CODES[casting], DT=_TL_DTYPES[x.dtype],
                                      WDT=_TL_DTYPES[weight.dtype] if need_dweight else tl.float32,
                                      EMULATE_BF16=INTERPRET, LOW=low and need_dx,
                                      FULL=_full(M, N, cfg, groups, cfg.lag if need_dx else 0, has_dh),
                                      num_warps=cfg.num_warps),
                         interpret=INTERPRET)
    if need_dweight and groups > 1:
        triton_dweight.reduce(partials, dweight, ("bands_dweight", *key))
    return dx, dweight
