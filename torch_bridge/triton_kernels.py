"""Triton RMSNorm kernels (forward + backward) implementing ``docs/semantics.md``.

Row math lives in ``@triton.jit`` helpers (``triton_rowmath``) used by both directions and by the band backward
(``triton_bands``, which both directions hand long rows: ``triton_config.BANDS_MIN_N`` / ``FWD_BANDS_MIN_N``):

    y    = r(n * w_eff)
    dweight = sum over rows of dy * n, float32 per-program partials summed in a fixed order.

Inputs are contiguous with any leading shape (rows are the last axis; kernels address memory by pointer) and
at least one row. Compute is float32 (float64 when x is float64, where every r(.) is the identity). Tiling comes
from ``triton_config``. On CPU the same kernels run under Triton's interpreter (``TRITON_INTERPRET=1``); its
float32->bfloat16 cast truncates, so there bfloat16 rounding is done with integer bit arithmetic (RNE).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pallas_norm import pallas_config
from pallas_norm.pallas_config import balanced, cdiv  # not triton.cdiv: a ConstexprFunction since Triton 3.5, ~1 µs
from torch_bridge import (custom_ops, triton_bands, triton_config, triton_dweight, triton_launch, triton_pieces,
                          triton_product, triton_two_pass)
from torch_bridge.triton_config import Config
from torch_bridge.triton_rowmath import (CASTING_CODES, INTERPRET, _TL_DTYPES, _bwd_weight, _dx, _grad_n, _normalize,
                                         _row, _rstd, _store_y, _tile, _to_dt, _w_eff, _weight_low)

# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def _fwd_kernel(X, R, W, Y, H, RSTD, M, N, n_f, eps, offset, G, ITERS,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKED: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                HAS_RESIDUAL: tl.constexpr, LOW: tl.constexpr, CASTING: tl.constexpr, DT: tl.constexpr,
                CT: tl.constexpr, EMULATE_BF16: tl.constexpr, EVICT: tl.constexpr, N_CONST: tl.constexpr):
    """BLOCK_M rows per program, one pass over registers; or, for long rows, a persistent grid of G programs
    (program p takes row blocks p, p + G, ...: few rows in flight, so more of each is still in L2 when it is read
    again) making two passes over column chunks. HAS_RESIDUAL (the fused add): the row is h = r(x + residual)
    (DT is h's dtype), stored to H; long rows add again in the second pass. LOW: y's product in DT
    (``_store_y``), the resident row's weight loaded first. EVICT: the resident row's loads' L1 eviction hint.
    N_CONST (the resident row): N as a compile-time constant, else 0."""
    cols0 = tl.arange(0, BLOCK_N)
    if not CHUNKED:
        if N_CONST:  # the row length a compile-time constant (``Config.n_const``)
            N = N_CONST
        w_low = 0.0
        if LOW:
            w_low = _weight_low(W, cols0, N, offset, CASTING, DT, CT, EMULATE_BF16, EVICT)
        rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        base = rows[:, None] * N
        mask = row_mask[:, None] & (cols0[None, :] < N)
        x = _row(X, R, H, base + cols0[None, :], mask, HAS_RESIDUAL, True, DT, CT, EMULATE_BF16, EVICT)
        rstd = _rstd(tl.sum(x * x, axis=1), n_f, eps, CT)
        _store_y(Y, W, base, cols0, mask, N, x, rstd, offset, w_low, HAS_WEIGHT, LOW, CASTING, DT, CT, EMULATE_BF16,
                 EVICT)
        tl.store(RSTD + rows, rstd, mask=row_mask)
    else:
        for it in range(0, ITERS):
            rows = (it * G + tl.program_id(0)).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
            row_mask = rows < M
            base = rows[:, None] * N
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=CT)
            for start in range(0, N, BLOCK_N):
                cols = start + cols0
                mask = row_mask[:, None] & (cols[None, :] < N)
                x = _row(X, R, H, base + cols[None, :], mask, HAS_RESIDUAL, False, DT, CT, EMULATE_BF16, "")
                acc += x * x
            rstd = _rstd(tl.sum(acc, axis=1), n_f, eps, CT)
            n_chunks = tl.cdiv(N, BLOCK_N)
            for i in range(0, n_chunks):  # backwards: the row's tail is the part most likely still in L2
                cols = (n_chunks - 1 - i) * BLOCK_N + cols0
                mask = row_mask[:, None] & (cols[None, :] < N)
                x = _row(X, R, H, base + cols[None, :], mask, HAS_RESIDUAL, True, DT, CT, EMULATE_BF16, "")
                w_low = 0.0
                if LOW:
                    w_low = _weight_low(W, cols, N, offset, CASTING, DT, CT, EMULATE_BF16, "")
                _store_y(Y, W, base, cols, mask, N, x, rstd, offset, w_low, HAS_WEIGHT, LOW, CASTING, DT, CT,
                         EMULATE_BF16, "")
            tl.store(RSTD + rows, rstd, mask=row_mask)


@triton.jit
def _bwd_rowdot_kernel(X, W, DY, C, M, N, offset,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                       CASTING: tl.constexpr, DT: tl.constexpr, CT: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """c = mean(g * x32) per row, over column chunks (the long-row backward's first pass)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    base = rows[:, None] * N
    cols0 = tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=CT)
    for start in range(0, N, BLOCK_N):
        cols = start + cols0
        mask = row_mask[:, None] & (cols[None, :] < N)
        x = tl.load(X + base + cols[None, :], mask=mask, other=0.0).to(CT)
        dy = tl.load(DY + base + cols[None, :], mask=mask, other=0.0).to(CT)
        w_eff = tl.zeros([BLOCK_N], dtype=CT)
        if HAS_WEIGHT:
            w_eff = _w_eff(tl.load(W + cols, mask=cols < N, other=0.0), offset, CASTING, DT, CT, EMULATE_BF16)
        acc += _grad_n(dy, w_eff, HAS_WEIGHT, CASTING, DT, CT, EMULATE_BF16) * x
    tl.store(C + rows, tl.sum(acc, axis=1) / N, mask=row_mask)


@triton.jit
def _bwd_block(X, DY, RSTD, rows, cols, col_mask, M, N):
    """Row block ``rows``' raw x and dy tiles and rstd (rows past M read zeros)."""
    row_mask = rows < M
    offs, mask = _tile(rows, row_mask, cols, col_mask, N)
    return tl.load(X + offs, mask=mask, other=0.0), tl.load(DY + offs, mask=mask, other=0.0), tl.load(
        RSTD + rows, mask=row_mask, other=0.0)


@triton.jit
def _bwd_kernel(X, W, DY, DH, RSTD, C, DX, DWP, M, N, G, ITERS, offset,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                NEED_DX: tl.constexpr, NEED_DW: tl.constexpr, HAS_DH: tl.constexpr, DW_DIRECT: tl.constexpr,
                PREFETCH: tl.constexpr, CASTING: tl.constexpr, DT: tl.constexpr, CT: tl.constexpr,
                WDT: tl.constexpr, EMULATE_BF16: tl.constexpr, LOW: tl.constexpr, N_CONST: tl.constexpr,
                RELOAD_W: tl.constexpr):
    """Persistent grid (G, column chunks): program (p, j) walks row blocks p, p+G, ... of chunk j.

    dx goes to a new buffer DX; dweight partials accumulate in registers and land in DWP[p, chunk]; with
    DW_DIRECT (G == 1: the program saw every row) DWP is dweight itself, stored as WDT.
    With SINGLE the chunk is the whole row and c = mean(g*x) is computed here, else read from C.
    HAS_DH (the fused add's backward, X being h): dx = r(dx_norm + dh_out), dh_out read from DH.
    PREFETCH: the next row block's x, dy and rstd are loaded before the current one's math (in flight meanwhile;
    the same values, hence the same bits). LOW (``triton_product.grad_in_dtype``: dy and w_eff both values of DT): g =
    r(dy · w_eff) as one multiply in DT, the float32 product's bits, w_eff held as DT (half the registers of float32).
    N_CONST (a full row held whole): N as a compile-time constant, else 0. RELOAD_W (``Config.reload_weight``): the
    weight is loaded again for every row block (an L1 hit) instead of held across the loop, and dweight's term is
    added before the row's sum, so that neither the weight nor dy is live across it (the same values, the same bits).
    """
    if N_CONST:  # the row length a compile-time constant (``Config.n_const``)
        N = N_CONST
    pid = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if not RELOAD_W:  # w_eff held across the loop
        w_eff = _bwd_weight(W, cols, col_mask, N, offset, HAS_WEIGHT, LOW, CASTING, DT, CT, EMULATE_BF16)
    dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=CT)
    if PREFETCH:
        x_next, dy_next, rstd_next = _bwd_block(X, DY, RSTD, pid * BLOCK_M + tl.arange(0, BLOCK_M), cols, col_mask,
                                                M, N)
    for it in range(0, ITERS):
        rows = (it * G + pid) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        offs, mask = _tile(rows, row_mask, cols, col_mask, N)
        if PREFETCH:
            x, dy, rstd = x_next, dy_next, rstd_next
            x_next, dy_next, rstd_next = _bwd_block(X, DY, RSTD, rows + G * BLOCK_M, cols, col_mask, M, N)
        else:
            x, dy, rstd = _bwd_block(X, DY, RSTD, rows, cols, col_mask, M, N)
        x = x.to(CT)
        if RELOAD_W and NEED_DX:  # the weight again from L1, not held
            w_eff = _bwd_weight(W, cols, col_mask, N, offset, HAS_WEIGHT, LOW, CASTING, DT, CT, EMULATE_BF16)
        if NEED_DX and LOW:
            g = (dy * w_eff[None, :]).to(CT)
        dy = dy.to(CT)
        if NEED_DW and RELOAD_W:  # before the row's sum: dy is not live across it
            dw_acc += dy * _normalize(x, rstd, CASTING, DT, CT, EMULATE_BF16)
        if NEED_DX:
            if not LOW:
                g = _grad_n(dy, w_eff, HAS_WEIGHT, CASTING, DT, CT, EMULATE_BF16)
            if SINGLE:
                c = tl.sum(g * x, axis=1) / N
            else:
                c = tl.load(C + rows, mask=row_mask, other=0.0)
            dx = _dx(x, g, rstd, c)
            if HAS_DH:
                dx += tl.load(DH + offs, mask=mask, other=0.0).to(CT)
            tl.store(DX + offs, _to_dt(dx, DT, EMULATE_BF16), mask=mask)
        if NEED_DW and not RELOAD_W:
            dw_acc += dy * _normalize(x, rstd, CASTING, DT, CT, EMULATE_BF16)
    if NEED_DW:
        if DW_DIRECT:
            tl.store(DWP + cols, _to_dt(tl.sum(dw_acc, axis=0), WDT, EMULATE_BF16), mask=col_mask)
        else:
            tl.store(DWP + pid.to(tl.int64) * N + cols, tl.sum(dw_acc, axis=0), mask=col_mask)


# ----------------------------------------------------------------------------------------------
# Host launchers
# ----------------------------------------------------------------------------------------------
def _common(x: torch.Tensor) -> dict:
    return dict(DT=_TL_DTYPES[x.dtype], CT=_TL_DTYPES[custom_ops.rstd_dtype(x)], EMULATE_BF16=INTERPRET)


def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, casting: str,
                 config: Config | None = None, rstd: torch.Tensor | None = None, *,
                 residual: torch.Tensor | None = None, h_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, ...]:
    """Forward of a contiguous ``x`` (M >= 1 rows of N): ``(y`` like x, ``rstd`` of shape ``x.shape[:-1])``;
    ``rstd`` is written into the buffer given (M elements of the compute dtype at least) instead, if one is.
    With ``residual`` (the fused add, same shape): ``(y, h, rstd)``, ``h = r(x + residual)`` in ``h_dtype`` and
    ``y`` (``h_dtype`` too) its norm."""
    M, N = custom_ops.rows(x)
    fused = residual is not None
    row_dtype = h_dtype if fused else x.dtype
    low = triton_product.output_in_dtype(weight, row_dtype, offset, casting)
    cfg = config or triton_config.forward_config(N, triton_launch.sm_count(x), row_dtype.itemsize, low, M, fused,
                                                   triton_launch.gpu_model(x))
    for option in ("pieces", "reload_weight"):
        if getattr(cfg, option):
            raise ValueError(f"{option} is an option of the backward, got {cfg} for the forward")
    if rstd is None:
        rstd = x.new_empty(x.shape[:-1], dtype=custom_ops.compute_dtype(row_dtype))
    if cfg.lag and cfg.chunked(N):  # column bands (a resident row ignores lag)
        if rstd.dtype == torch.float32:
            return triton_bands.forward(x, weight, eps, offset, casting, cfg, config, rstd, residual, h_dtype)
        cfg = triton_config.chunked_forward_config()  # float64: its partial sums do not fit the 32-bit slots
    h = torch.empty_like(x, dtype=h_dtype) if fused else None
    y = torch.empty_like(x, dtype=row_dtype)
    key = ("fwd", M, N, x.dtype, custom_ops.dtype_of(weight), eps, offset, casting, config, x.get_device(),
           custom_ops.dtype_of(residual), h_dtype, low)
    if cfg.l1_hints and cfg.chunked(N):
        triton_two_pass.forward(x, residual, weight, y, h, rstd, eps, offset, casting, cfg, key,
                                lambda: dict(HAS_WEIGHT=weight is not None, HAS_RESIDUAL=fused, LOW=low, **_common(y)))
        return (y, h, rstd) if fused else (y, rstd)
    row_blocks = cdiv(M, cfg.block_m)
    g = min(row_blocks, cfg.programs_per_sm * triton_launch.sm_count(x)) if cfg.chunked(N) else row_blocks
    triton_launch.launch(key, _fwd_kernel, (g,),
                         (x, residual if fused else x, weight if weight is not None else x, y, h if fused else y, rstd,
                          M, N, float(N), eps, offset, g, cdiv(row_blocks, g)),
                         lambda: dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CHUNKED=cfg.chunked(N),
                                      HAS_WEIGHT=weight is not None, HAS_RESIDUAL=fused,
                                      LOW=low, EVICT="evict_last" if cfg.l1_hints else "",
                                      CASTING=CASTING_CODES[casting], num_warps=cfg.num_warps,
                                      N_CONST=N if cfg.n_const and not cfg.chunked(N) else 0, **_common(y)),
                         interpret=INTERPRET)
    return (y, h, rstd) if fused else (y, rstd)


def backward_register_cap(programs: int, sms: int, num_warps: int, iters: int) -> int | None:
    """The most registers per thread for the backward's grid of ``programs`` walking ``iters`` row blocks each
    (``triton_launch.launch``'s ``max_registers``, in its meta-parameters, built on the first launch only: a kernel
    taking more is compiled again under that cap): where they walk more than one, the registers that let all of them
    be resident at once (``pallas_config.registers_per_thread``, as the Pallas kernels' ``register_cap``) if below the
    hardware's 255; None otherwise. Without it the fused add's pieces backward for Gemma took 162 registers: 3 of 4
    programs per SM fitted at 2560 columns, 1 of 2 at 5120 (probes_h200_2026-11-29_fortyninth.md §7), and the grid
    ran a second wave. Only where a kernel exceeds it: capping kernels that fitted anyway moved them by -1.4% to
    +0.2% (ptxas's schedule; fiftieth session)."""
    cap = pallas_config.registers_per_thread(cdiv(programs, sms), num_warps) if iters > 1 else None
    return cap if cap is not None and cap < 255 else None


def rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor,
                 offset: float, casting: str, need_dx: bool, need_dweight: bool, config: Config | None = None, *,
                 dh_out: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Backward of contiguous ``x``/``dy`` (M >= 1 rows): ``(dx`` or None, ``dweight`` or None).

    dx is a new buffer (dy is only read); dweight is the fixed-order sum of float32 per-program partials (on
    column bands, ``cfg.lag``: each band's sum over rows, stored by its program). ``cfg.pieces``: rows held as their
    two power-of-two pieces (``triton_pieces``). With ``dh_out`` (the fused add's backward, ``x`` being ``h``):
    ``dx = r(dx_norm + dh_out)``, i.e. ``dh``.
    """
    M, N = custom_ops.rows(x)
    has_dh = dh_out is not None and need_dx
    # g = r(dy·w_eff) one multiply in x's dtype: rms_norm's backward (the fused add's was not measured with it)
    low = not has_dh and triton_product.grad_in_dtype(weight, x.dtype, offset, casting, N, M)
    # the fused add's tile at the pieces' widths follows the GPU and the weight's product
    # (triton_config.BWD_PIECES_FUSED_LOW_BY_MODEL; asked there only: ~0.4 µs of host time)
    by_model = has_dh and N in triton_config.BWD_PIECES
    tile_low = triton_product.output_in_dtype(weight, x.dtype, offset, casting) if by_model else low
    # arguments given positionally: keywords made this per-call lookup 79 → 168 ns when it was the cache itself
    cfg = config or triton_config.backward_config(N, triton_launch.sm_count(x), has_dh, tile_low, M, x.itemsize,
                                                  triton_launch.gpu_model(x) if by_model else "")
    if cfg.lag and cfg.chunked(N):  # column bands (a resident row ignores lag)
        if custom_ops.rstd_dtype(x) == torch.float32:
            return triton_bands.backward(dy, x, weight, rstd, offset, casting, need_dx, need_dweight, cfg, config,
                                         dh_out=dh_out, low=low)
        cfg = triton_config.chunked_backward_config()  # float64: its partial sums do not fit the 32-bit slots
    if cfg.l1_hints:
        raise ValueError(f"l1_hints is an option of the forward, got {cfg} for the backward")
    pieces = triton_pieces.two_pieces(N) if cfg.pieces else None
    if pieces and cfg.chunked(N):
        raise ValueError(f"pieces is an option of the backward of rows held whole (block_n >= {N}), got {cfg}")
    need_dweight = need_dweight and weight is not None
    dx = torch.empty_like(x) if need_dx else None
    cdt = custom_ops.rstd_dtype(x)
    w_arg = weight if weight is not None else x
    chunked = cfg.chunked(N)
    c = rstd  # placeholder pointer when unused
    key = (M, N, x.dtype, custom_ops.dtype_of(weight), offset, casting, config, x.get_device(), has_dh)
    if chunked and need_dx:
        c = x.new_empty((M,), dtype=cdt)
        triton_launch.launch(("rowdot", *key), _bwd_rowdot_kernel, (M,), (x, w_arg, dy, c, M, N, offset),
                             lambda: dict(BLOCK_M=1, BLOCK_N=cfg.rowdot_block_n, HAS_WEIGHT=weight is not None,
                                          CASTING=CASTING_CODES[casting], num_warps=cfg.rowdot_warps, **_common(x)),
                             interpret=INTERPRET)
    n_chunks = cdiv(N, cfg.block_n)
    row_blocks = cdiv(M, cfg.block_m)
    if M * N <= cfg.one_program_elems:
        g = 1
    else:
        g = max(1, min(row_blocks, cfg.programs_per_sm * triton_launch.sm_count(x) // n_chunks))
        if not chunked:  # the fewest programs keeping the most row blocks each (triton_config's note)
            g = balanced(g, row_blocks)
    direct = need_dweight and g == 1  # the one program per chunk sums every row: it stores dweight itself
    dweight = torch.empty_like(weight) if need_dweight else None
    partials = (dweight if direct else x.new_empty((g, N), dtype=cdt)) if need_dweight else rstd
    triton_launch.launch(("bwd", need_dx, need_dweight, low, *key), triton_pieces.bwd_pieces_kernel if pieces else
                         _bwd_kernel, (g, n_chunks),
                         (x, w_arg, dy, dh_out if has_dh else dy, rstd, c, dx if need_dx else x, partials, M, N, g,
                          cdiv(row_blocks, g), offset),
                         lambda: dict(BLOCK_M=cfg.block_m,
                                      **(dict(P0=pieces[0], P1=pieces[1]) if pieces else
                                         dict(BLOCK_N=cfg.block_n, SINGLE=not chunked)),
                                      HAS_WEIGHT=weight is not None, NEED_DX=need_dx, NEED_DW=need_dweight,
                                      HAS_DH=has_dh, DW_DIRECT=direct, PREFETCH=cfg.prefetch,
                                      CASTING=CASTING_CODES[casting],
                                      WDT=_TL_DTYPES[weight.dtype] if need_dweight else _TL_DTYPES[cdt],
                                      num_warps=cfg.num_warps,
                                      **({} if pieces else dict(LOW=low, N_CONST=N if cfg.n_const and not chunked
                                                                else 0, RELOAD_W=cfg.reload_weight)),
                                      max_registers=backward_register_cap(g * n_chunks, triton_launch.sm_count(x),
                                                                          cfg.num_warps, cdiv(row_blocks, g)),
                                      **_common(x)),
                         interpret=INTERPRET)
    if not need_dweight or direct:
        return dx, dweight
    triton_dweight.reduce(partials, dweight, ("dweight", g, *key))
    return dx, dweight
