"""The Pallas RMSNorm kernels (forward, backward) and their ``pallas_call`` launchers.

All on 2-D ``(m, n)`` inputs with m >= 1 (the API handles empty inputs), tiled by a fitted
``pallas_config.Config``. Row math comes from ``rowmath``; memory access from ``backend``.
Forward: one program per ``block_rows`` rows when the row is resident in registers; long rows are walked in
column chunks (sum of squares first, then normalise, backwards) by a persistent grid. Backward: a persistent grid
of ``config.programs`` programs, each keeping a float32 ``dweight`` partial in registers; the partials are then
summed in a fixed order by ``dweight.reduce_dweight`` (no atomics), so ``dweight`` is bitwise reproducible; a grid
of one program stores ``dweight`` itself (one launch). Tile loads and their masks come from ``tiles``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from . import backend, rowmath, triton_ffi
from .dweight import reduce_dweight
from .order_tables import DH_LOAD, DW_PER_ROW, H_FIRST_MAX_COLS, WEIGHT_FIRST_F32_MAX_COLS, WEIGHT_FIRST_MAX_COLS
from .pallas_config import Config, cdiv, pieces_of, register_cap
from .rounding import rounder
from .tiles import (F32, _col_mask, _grad, _rstd, _span, _tile, _tile_mask, _weight, _weight_of, grad_in_dtype,
                    product_in_dtype)


def _spans(config: Config, n: int, chunk) -> list:
    """The ``(cols, cmask)`` spans a program's tiles cover: column chunk ``chunk`` of ``block_cols`` (a resident
    row: chunk 0, padded and masked), or with ``config.pieces`` the row's power-of-two pieces in order (exact: no
    column mask, ``cmask`` None)."""
    if not config.pieces:
        return [_span(chunk * config.block_cols, config.block_cols, n)]
    spans, start = [], 0
    for size in pieces_of(n):
        spans.append((_span(start, size, n)[0], None))
        start += size
    return spans


def _fwd_kernel(*refs, m, n, eps, offset, casting, config: Config, has_weight: bool, has_residual: bool = False):
    """Resident rows: program ``i`` normalises row block ``i``. Long rows: a persistent grid of ``config.programs``
    programs, program ``pid`` taking row blocks pid, pid + programs, ...; each row is walked twice, chunk by
    chunk: sum of squares forwards, then normalise backwards (the chunks read last in the first pass are the
    likeliest still in L2; with ``config.l1_hints`` the first pass keeps them in L1 for the second; a resident row's
    loads then all carry ``evict_last``). With ``config.prefetch`` the next chunk is loaded before the current one is
    used.
    ``has_residual`` (the fused add): the row normalised is ``h = r_h(x + residual)``, also stored (refs
    ``x, residual, [weight], y, h, rstd``); long rows add again in the second pass instead of re-reading ``h``."""
    refs = list(refs)
    x_ref = refs.pop(0)
    res_ref = refs.pop(0) if has_residual else None
    w_ref = refs.pop(0) if has_weight else None
    y_ref = refs.pop(0)
    h_ref = refs.pop(0) if has_residual else None
    rstd_ref = refs.pop(0)
    dt = y_ref.dtype
    br, bc, chunks = config.block_rows, config.block_cols, config.chunks(n)
    # y's product in the input dtype where exact (probes_h100_2026-11-26_twentyfirst.md §4: 4096×5120 2.73 → 2.80 TB/s)
    low = product_in_dtype(None if w_ref is None else w_ref.dtype, dt, casting, offset)
    # ``config.l1_hints``: the L1 hints of the first and second reads (a resident row's only read: the first; its
    # weight's too)
    keep, stream = ("evict_last", "evict_first") if config.l1_hints else (None, None)
    w_hint = keep if chunks == 1 else None

    def weight(cols, cmask):
        """The weight over ``cols``: ``w_eff`` in float32, or with ``low`` in ``dt`` (llama: as stored)."""
        return _weight_of(w_ref, cols, cmask, offset, casting, dt, low, w_hint)

    def store_h(rows, rmask, k, h32):
        cols, cmask = _span(k * bc, bc, n)
        backend.store(h_ref.at[rows[:, None], cols[None, :]], h32.astype(dt), rmask[:, None] & cmask[None, :])

    h_first = h_ref is not None and chunks == 1 and bc <= H_FIRST_MAX_COLS  # stored before the row's sum

    def emit(rows, rmask, k, h32, rstd, w=None):
        cols, cmask = _span(k * bc, bc, n)
        mask = rmask[:, None] & cmask[None, :]
        if h_ref is not None and not h_first:
            store_h(rows, rmask, k, h32)
        n_val = rowmath.normalized(h32, rstd[:, None], casting, rounder(dt))
        w = weight(cols, cmask) if w is None else w
        y = rowmath.output(n_val.astype(dt), w) if low else rowmath.output(n_val, w).astype(dt)
        backend.store(y_ref.at[rows[:, None], cols[None, :]], y, mask)

    def fetch(rows, rmask, k, eviction=None):
        """The raw ``(rows, chunk k)`` tiles of x (and residual) (chunks outside the row read nothing)."""
        cols, cmask = _span(k * bc, bc, n)
        cmask = cmask & (k >= 0) & (k < chunks)
        x = _tile(x_ref, rows, rmask, cols, cmask, dtype=None, eviction=eviction)
        return x if res_ref is None else (x, _tile(res_ref, rows, rmask, cols, cmask, dtype=None, eviction=eviction))

    def row(tiles):
        """The row values normalised, widened to float32: x, or ``h = r_h(x + residual)`` (h's dtype is y's)."""
        if res_ref is None:
            return tiles.astype(F32)
        return rowmath.residual_add(tiles[0].astype(F32), tiles[1].astype(F32), rounder(dt))

    if chunks == 1:
        rows, rmask = _span(pl.program_id(0) * br, br, m)
        first = WEIGHT_FIRST_MAX_COLS if low else WEIGHT_FIRST_F32_MAX_COLS if h_ref is None else 0
        w = weight(*_span(0, bc, n)) if w_ref is not None and bc <= first else None
        h32 = row(fetch(rows, rmask, 0, keep))
        if h_first:
            store_h(rows, rmask, 0, h32)
        rstd = _rstd(jnp.sum(h32 * h32, axis=1), n, eps)
        emit(rows, rmask, 0, h32, rstd, w)
        backend.store(rstd_ref.at[rows], rstd, rmask)
        return

    pid = pl.program_id(0)

    @pl.loop(0, cdiv(cdiv(m, br), config.programs))
    def _(t):
        rows, rmask = _span((pid + t * config.programs) * br, br, m)
        sumsq = _walk(chunks, config.prefetch, lambda k: fetch(rows, rmask, k, keep),
                      lambda k, tiles, acc: acc + _sq(row(tiles)), jnp.zeros((br, bc), F32))
        rstd = _rstd(jnp.sum(sumsq, axis=1), n, eps)
        last = chunks - 1
        _walk(chunks, config.prefetch, lambda k: fetch(rows, rmask, last - k, stream),
              lambda k, tiles, _: emit(rows, rmask, last - k, row(tiles), rstd), None)
        backend.store(rstd_ref.at[rows], rstd, rmask)


def _sq(x32):
    return x32 * x32


def _walk(steps: int, prefetch: bool, fetch, use, carry):
    """``carry = use(k, fetch(k), carry)`` for k = 0 … steps-1; with ``prefetch``, ``fetch(k + 1)`` is issued
    before ``use(k, …)`` (its loads are in flight while step k computes; ``fetch(steps)`` must load nothing)."""
    if not prefetch:
        return lax.fori_loop(0, steps, lambda k, c: use(k, fetch(k), c), carry)

    def body(k, state):
        tile, c = state
        nxt = fetch(k + 1)
        return nxt, use(k, tile, c)

    return lax.fori_loop(0, steps, body, (fetch(0), carry))[1]


def _bwd_inputs(refs: list, has_weight: bool, has_dh_out: bool) -> tuple:
    """Pop a backward kernel's leading refs ``x, [weight], dy, [dh_out], rstd`` (None for those absent)."""
    x_ref = refs.pop(0)
    w_ref = refs.pop(0) if has_weight else None
    dy_ref = refs.pop(0)
    dh_ref = refs.pop(0) if has_dh_out else None
    return x_ref, w_ref, dy_ref, dh_ref, refs.pop(0)


def _dh_tile(dh_ref, rows, rmask, cols, cmask):
    """A row block's dh_out tile in its dtype, loaded within the block (``DH_LOAD``)."""
    return _tile(dh_ref, rows, rmask, cols, cmask, dtype=None)


def _bwd_kernel(*refs, m, n, offset, casting, config: Config, has_weight, need_dx, need_dw, has_dh_out=False):
    """Persistent backward: program ``pid`` takes row blocks pid, pid + programs, ...; writes their ``dx`` and
    one float32 ``dweight`` partial. Resident rows: one program per row block set, ``sum(g·x)`` in registers (with
    ``config.pieces`` the row's power-of-two pieces, their sums added in piece order). Chunked rows: program
    ``(pid, j)`` owns column chunk ``j`` and reads ``sum(g·x)`` from the rowsum kernel. ``has_dh_out`` (the fused
    add's backward, x being h): ``dx = r(dx_norm + dh_out)`` (refs ``…, dy, dh_out, rstd, …``; dh_out loaded
    in its block at ``DH_LOAD``'s widths). dweight's terms are summed over each row block's rows every block; tiles
    of several rows of ``DW_PER_ROW``'s widths keep them per tile row, summed once after the loop (other bits)."""
    refs = list(refs)
    x_ref, w_ref, dy_ref, dh_ref, rstd_ref = _bwd_inputs(refs, has_weight, has_dh_out)
    s_ref = None if config.resident(n) else refs.pop(0)
    dx_ref = refs.pop(0) if need_dx else None
    dwp_ref = refs.pop(0) if need_dw else None
    dt = dy_ref.dtype
    br, programs = config.block_rows, config.programs
    pid = pl.program_id(0)
    spans = _spans(config, n, 0 if s_ref is None else pl.program_id(1))
    low = grad_in_dtype(None if w_ref is None else w_ref.dtype, dt, casting, offset, fused=has_dh_out)

    def weights():
        """``w_eff`` per span: float32, or with ``low`` values of ``dt``."""
        return [_weight_of(w_ref, c, cm, offset, casting, dt, low) for c, cm in spans]

    w_eff = None if config.reload_weight else weights()
    dh_at = DH_LOAD.get(config.block_cols) if dh_ref is not None and need_dx and config.resident(n) else None
    if dh_at not in (None, "block", "use"):
        raise ValueError(f"DH_LOAD[{config.block_cols}] must be 'block' or 'use', got {dh_at!r}")
    dh_ahead = dh_ref is not None and need_dx and dh_at is None  # dh_out fetched with x and dy

    def fetch(t):
        """Row block ``t`` of this program: raw x and dy tiles per span, rstd, [dh_out tiles] (blocks past the last
        row read nothing)."""
        rows, rmask = _span((pid + t * programs) * br, br, m)

        def tiles(ref):
            return tuple(_tile(ref, rows, rmask, c, cm, dtype=None) for c, cm in spans)

        fetched = (tiles(x_ref), tiles(dy_ref), backend.load(rstd_ref.at[rows], rmask))
        return fetched + (tiles(dh_ref),) if dh_ahead else fetched

    per_row = config.resident(n) and br > 1 and config.block_cols in DW_PER_ROW

    def dweight_terms(dw_acc, x32, dy32, rstd):
        terms = (rowmath.dweight_terms(d, rowmath.normalized(xp, rstd, casting, rounder(dt))) for d, xp in
                 zip(dy32, x32))
        return tuple(acc + (t if per_row else jnp.sum(t, axis=0)) for acc, t in zip(dw_acc, terms))

    def use(t, tiles, dw_acc):
        rows, rmask = _span((pid + t * programs) * br, br, m)
        x32, dy32 = ([a.astype(F32) for a in tiles[i]] for i in (0, 1))
        rstd = tiles[2][:, None]
        dh = ([_dh_tile(dh_ref, rows, rmask, c, cm) for c, cm in spans] if dh_at == "block" else
              tiles[3] if dh_ahead else None)
        if need_dw and config.reload_weight:  # before the row's sum: dy is not live across it (the same bits)
            dw_acc = dweight_terms(dw_acc, x32, dy32, rstd)
        if need_dx:
            ws = weights() if config.reload_weight else w_eff
            g = [_grad(d, w, casting, dt, low, d32) for d, d32, w in zip(tiles[1], dy32, ws)]
            if s_ref is None:
                sum_gx = None
                for gp, xp in zip(g, x32):
                    part = jnp.sum(gp * xp, axis=1, keepdims=True)
                    sum_gx = part if sum_gx is None else sum_gx + part
            else:
                sum_gx = backend.load(s_ref.at[rows], rmask)[:, None]
            for i, (c, cm) in enumerate(spans):
                dx = rowmath.grad_input(x32[i], g[i], rstd, sum_gx, F32(n))
                if dh_ref is not None:
                    dhp = _dh_tile(dh_ref, rows, rmask, c, cm) if dh_at == "use" else dh[i]
                    dx = rowmath.grad_residual(dx, dhp.astype(F32))
                dx = dx.astype(dt)
                backend.store(dx_ref.at[rows[:, None], c[None, :]], dx, _tile_mask(rmask, c, cm))
        if need_dw and not config.reload_weight:
            dw_acc = dweight_terms(dw_acc, x32, dy32, rstd)
        return dw_acc

    dw = _walk(cdiv(cdiv(m, br), programs), config.prefetch, fetch, use,
               tuple(jnp.zeros((br, *c.shape) if per_row else c.shape, F32) for c, _ in spans))
    for acc, (c, cm) in zip(dw, spans) if need_dw else ():
        acc = jnp.sum(acc, axis=0) if per_row else acc
        mask = _col_mask(c, cm)
        if len(dwp_ref.shape) == 1:  # one program (per chunk) saw every row: dweight itself
            backend.store(dwp_ref.at[c], acc.astype(dwp_ref.dtype), mask)
        else:
            backend.store(dwp_ref.at[pid, c], acc, mask)


def _bwd_rowsum_kernel(*refs, m, n, offset, casting, config: Config, has_weight):
    """Long rows, step 1: ``sum(g · x32)`` per row, walking the row in column chunks."""
    x_ref, w_ref, dy_ref, s_ref = refs if has_weight else (refs[0], None, *refs[1:])
    dt = dy_ref.dtype
    br, bc, chunks = config.block_rows, config.block_cols, config.chunks(n)
    rows, rmask = _span(pl.program_id(0) * br, br, m)

    def fetch(k):
        cols, cmask = _span(k * bc, bc, n)
        cmask = cmask & (k < chunks)
        return _tile(x_ref, rows, rmask, cols, cmask, dtype=None), _tile(dy_ref, rows, rmask, cols, cmask, dtype=None)

    def use(k, tiles, acc):
        cols, cmask = _span(k * bc, bc, n)
        g = rowmath.grad_scale(tiles[1].astype(F32), _weight(w_ref, cols, cmask, offset, casting, dt), casting,
                               rounder(dt))
        return acc + g * tiles[0].astype(F32)

    acc = _walk(chunks, config.prefetch, fetch, use, jnp.zeros((br, bc), F32))
    backend.store(s_ref.at[rows], jnp.sum(acc, axis=1), rmask)


def _no_bands(config: Config) -> None:
    if config.lag:
        raise ValueError(f"config has lag={config.lag}: a band config runs through bands.forward/backward (the API "
                         "dispatches on it), not these kernels")


def _run(call, args: tuple, out_shape, config: Config, interpret: bool) -> tuple:
    """``call(*args)`` (a ``pallas_call``'s outputs, a tuple), or with ``config.ffi_launch`` on the GPU the same kernel
    launched by jaxlib's Triton call (``triton_ffi``) instead of by XLA."""
    if config.ffi_launch and not interpret:
        return tuple(triton_ffi.launch(call, args, out_shape, maxnreg=register_cap(config)))
    return call(*args)


def forward(x, weight, *, eps: float, offset: float, casting: str, config: Config, interpret: bool,
            residual=None, h_dtype=None):
    """``(y, rstd)`` for a 2-D ``x`` of shape ``(m, n)``; ``rstd`` is float32 of shape ``(m,)``. With ``residual``
    (the fused add): ``(y, h, rstd)``, ``h = r(x + residual)`` in ``h_dtype`` and ``y`` the norm of ``h``."""
    _no_bands(config)
    m, n = x.shape
    fused = residual is not None
    kernel = functools.partial(_fwd_kernel, m=m, n=n, eps=eps, offset=offset, casting=casting, config=config,
                               has_weight=weight is not None, has_residual=fused)
    args = (x, *((residual,) if fused else ()), *(() if weight is None else (weight,)))
    row_dtype = h_dtype if fused else x.dtype
    out_shape = (jax.ShapeDtypeStruct((m, n), row_dtype), *(jax.ShapeDtypeStruct((m, n), row_dtype),) * fused,
                 jax.ShapeDtypeStruct((m,), F32))
    call = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(cdiv(m, config.block_rows) if config.resident(n) else config.programs,),
        compiler_params=backend.compiler_params(config.num_warps, config.num_stages, interpret=interpret),
        interpret=interpret,
        name="pallas_norm_add_fwd" if fused else "pallas_norm_fwd",
    )
    return _run(call, args, out_shape, config, interpret)


def backward(x, weight, dy, rstd, *, offset: float, casting: str, config: Config, interpret: bool,
             need_dx: bool = True, need_dw: bool = True, dh_out=None):
    """``(dx, dweight)`` for 2-D ``x``/``dy`` (``None`` for what is not needed); ``dy`` is only read. With
    ``dh_out`` (the fused add's backward, ``x`` being ``h``): ``dx = r(dx_norm + dh_out)``, i.e. ``dh``."""
    _no_bands(config)
    m, n = x.shape
    has_weight = weight is not None
    need_dw = need_dw and has_weight
    statics = dict(m=m, n=n, offset=offset, casting=casting, config=config, has_weight=has_weight)
    w_args = (weight,) if has_weight else ()
    params = backend.compiler_params(config.num_warps, config.num_stages, interpret=interpret)
    out_shape = []
    if need_dx:
        out_shape.append(jax.ShapeDtypeStruct((m, n), x.dtype))
    direct = need_dw and config.programs == 1  # the one program stores dweight: no partials, no reduction
    if need_dw:
        out_shape.append(jax.ShapeDtypeStruct((n,), weight.dtype) if direct else
                         jax.ShapeDtypeStruct((config.programs, n), F32))
    if not out_shape:
        return None, None
    fused = dh_out is not None and need_dx
    bwd = functools.partial(_bwd_kernel, **statics, need_dx=need_dx, need_dw=need_dw, has_dh_out=fused)
    row_args = (dy, dh_out) if fused else (dy,)
    prefix = "pallas_norm_add_bwd" if fused else "pallas_norm_bwd"
    if config.resident(n):
        call = pl.pallas_call(bwd, out_shape=tuple(out_shape), grid=(config.programs,), compiler_params=params,
                              interpret=interpret, name=prefix)
        outs = _run(call, (x, *w_args, *row_args, rstd), tuple(out_shape), config, interpret)
    else:
        sum_gx = pl.pallas_call(
            functools.partial(_bwd_rowsum_kernel, **statics),
            out_shape=jax.ShapeDtypeStruct((m,), F32), grid=(cdiv(m, config.block_rows),),
            compiler_params=params, interpret=interpret, name="pallas_norm_bwd_rowsum",
        )(x, *w_args, dy)
        outs = pl.pallas_call(
            bwd, out_shape=tuple(out_shape), grid=(config.programs, config.chunks(n)), compiler_params=params,
            interpret=interpret, name=f"{prefix}_chunks",
        )(x, *w_args, *row_args, rstd, sum_gx)
    outs = list(outs)
    dx = outs.pop(0) if need_dx else None
    dweight = outs.pop(0) if direct else None
    if need_dw and not direct:
        dweight = reduce_dweight(outs.pop(0), weight.dtype, interpret=interpret)
    return dx, dweight
