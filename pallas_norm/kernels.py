"""The Pallas RMSNorm kernels (forward, backward, dweight reduction) and their ``pallas_call`` launchers.

All on 2-D ``(m, n)`` inputs with m >= 1 (the API handles empty inputs), tiled by a fitted
``pallas_config.Config``. Row math comes from ``rowmath``; memory access from ``backend``.
Forward: one program per ``block_rows`` rows; the row is resident in registers or walked in column chunks
(sum of squares first, then normalise). Backward: a persistent grid of ``config.programs`` programs, each
keeping a float32 ``dweight`` partial in registers; the partials are then summed in a fixed order by
``_dweight_reduce_kernel`` (no atomics), so ``dweight`` is bitwise reproducible.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from . import backend, rowmath
from .pallas_config import Config, cdiv
from .rounding import rounder

F32 = jnp.float32
REDUCE_COLS = 1024


def _span(start, size: int, limit: int):
    idx = start + jnp.arange(size, dtype=jnp.int32)
    return idx, idx < limit


def _tile(ref, rows, rmask, cols, cmask):
    """Load an ``(rows, cols)`` tile as float32 (masked-off lanes read 0)."""
    return backend.load(ref.at[rows[:, None], cols[None, :]], rmask[:, None] & cmask[None, :]).astype(F32)


def _weight(w_ref, cols, cmask, offset: float, casting: str, dt):
    if w_ref is None:
        return None
    w32 = backend.load(w_ref.at[cols], cmask).astype(F32)
    return rowmath.effective_weight(w32, F32(offset), casting, rounder(dt))[None, :]


def _rstd(sumsq, n: int, eps: float):
    return rowmath.rstd_from_sumsq(sumsq, F32(n), F32(eps), lax.rsqrt)


def _fwd_kernel(*refs, m, n, eps, offset, casting, config: Config, has_weight: bool):
    x_ref, w_ref, y_ref, rstd_ref = refs if has_weight else (refs[0], None, *refs[1:])
    dt = y_ref.dtype
    br, bc, chunks = config.block_rows, config.block_cols, config.chunks(n)
    rows, rmask = _span(pl.program_id(0) * br, br, m)

    def emit(cols, cmask, x32, rstd):
        n_val = rowmath.normalized(x32, rstd[:, None], casting, rounder(dt))
        y = rowmath.output(n_val, _weight(w_ref, cols, cmask, offset, casting, dt)).astype(dt)
        backend.store(y_ref.at[rows[:, None], cols[None, :]], y, rmask[:, None] & cmask[None, :])

    def chunk(k):
        cols, cmask = _span(k * bc, bc, n)
        return cols, cmask, _tile(x_ref, rows, rmask, cols, cmask)

    if chunks == 1:
        cols, cmask, x32 = chunk(0)
        rstd = _rstd(jnp.sum(x32 * x32, axis=1), n, eps)
        emit(cols, cmask, x32, rstd)
    else:
        def sumsq(k, acc):
            x32 = chunk(k)[2]
            return acc + x32 * x32

        acc = lax.fori_loop(0, chunks, sumsq, jnp.zeros((br, bc), F32))
        rstd = _rstd(jnp.sum(acc, axis=1), n, eps)

        @pl.loop(0, chunks)
        def _(k):
            emit(*chunk(k), rstd)
    backend.store(rstd_ref.at[rows], rstd, rmask)


def _bwd_kernel(*refs, m, n, offset, casting, config: Config, has_weight, need_dx, need_dw):
    """Persistent backward: program ``pid`` takes row blocks pid, pid + programs, ...; writes their ``dx`` and
    one float32 ``dweight`` partial. Resident rows: one program per row block set, ``sum(g·x)`` in registers.
    Chunked rows: program ``(pid, j)`` owns column chunk ``j`` and reads ``sum(g·x)`` from the rowsum kernel."""
    refs = list(refs)
    x_ref = refs.pop(0)
    w_ref = refs.pop(0) if has_weight else None
    dy_ref, rstd_ref = refs.pop(0), refs.pop(0)
    s_ref = None if config.resident(n) else refs.pop(0)
    dx_ref = refs.pop(0) if need_dx else None
    dwp_ref = refs.pop(0) if need_dw else None
    dt = dy_ref.dtype
    br, bc, programs = config.block_rows, config.block_cols, config.programs
    pid = pl.program_id(0)
    cols, cmask = _span(0 if s_ref is None else pl.program_id(1) * bc, bc, n)
    w_eff = _weight(w_ref, cols, cmask, offset, casting, dt)

    def body(t, dw_acc):
        rows, rmask = _span((pid + t * programs) * br, br, m)
        x32 = _tile(x_ref, rows, rmask, cols, cmask)
        dy32 = _tile(dy_ref, rows, rmask, cols, cmask)
        rstd = backend.load(rstd_ref.at[rows], rmask)[:, None]
        if need_dx:
            g = rowmath.grad_scale(dy32, w_eff, casting, rounder(dt))
            if s_ref is None:
                sum_gx = jnp.sum(g * x32, axis=1, keepdims=True)
            else:
                sum_gx = backend.load(s_ref.at[rows], rmask)[:, None]
            dx = rowmath.grad_input(x32, g, rstd, sum_gx, F32(n)).astype(dt)
            backend.store(dx_ref.at[rows[:, None], cols[None, :]], dx, rmask[:, None] & cmask[None, :])
        if need_dw:
            n_val = rowmath.normalized(x32, rstd, casting, rounder(dt))
            dw_acc = dw_acc + jnp.sum(rowmath.dweight_terms(dy32, n_val), axis=0)
        return dw_acc

    dw = lax.fori_loop(0, cdiv(cdiv(m, br), programs), body, jnp.zeros((bc,), F32))
    if need_dw:
        backend.store(dwp_ref.at[pid, cols], dw, cmask)


def _bwd_rowsum_kernel(*refs, m, n, offset, casting, config: Config, has_weight):
    """Long rows, step 1: ``sum(g · x32)`` per row, walking the row in column chunks."""
    x_ref, w_ref, dy_ref, s_ref = refs if has_weight else (refs[0], None, *refs[1:])
    dt = dy_ref.dtype
    br, bc = config.block_rows, config.block_cols
    rows, rmask = _span(pl.program_id(0) * br, br, m)

    def body(k, acc):
        cols, cmask = _span(k * bc, bc, n)
        x32 = _tile(x_ref, rows, rmask, cols, cmask)
        g = rowmath.grad_scale(_tile(dy_ref, rows, rmask, cols, cmask),
                               _weight(w_ref, cols, cmask, offset, casting, dt), casting, rounder(dt))
        return acc + g * x32

    acc = lax.fori_loop(0, config.chunks(n), body, jnp.zeros((br, bc), F32))
    backend.store(s_ref.at[rows], jnp.sum(acc, axis=1), rmask)


def _dweight_reduce_kernel(dwp_ref, dw_ref, *, n: int, parts: int):
    """``dweight[cols] = Σ_p partials[p, cols]``, summed in program order p = 0, 1, ... (deterministic)."""
    cols, cmask = _span(pl.program_id(0) * REDUCE_COLS, REDUCE_COLS, n)
    acc = lax.fori_loop(0, parts, lambda p, a: a + backend.load(dwp_ref.at[p, cols], cmask),
                        jnp.zeros((REDUCE_COLS,), F32))
    backend.store(dw_ref.at[cols], acc.astype(dw_ref.dtype), cmask)


def forward(x, weight, *, eps: float, offset: float, casting: str, config: Config, interpret: bool):
    """``(y, rstd)`` for a 2-D ``x`` of shape ``(m, n)``; ``rstd`` is float32 of shape ``(m,)``."""
    m, n = x.shape
    kernel = functools.partial(_fwd_kernel, m=m, n=n, eps=eps, offset=offset, casting=casting, config=config,
                               has_weight=weight is not None)
    args = (x,) if weight is None else (x, weight)
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((m, n), x.dtype), jax.ShapeDtypeStruct((m,), F32)),
        grid=(cdiv(m, config.block_rows),),
        compiler_params=backend.compiler_params(config.num_warps, config.num_stages, interpret=interpret),
        interpret=interpret,
        name="pallas_norm_fwd",
    )(*args)


def backward(x, weight, dy, rstd, *, offset: float, casting: str, config: Config, interpret: bool,
             need_dx: bool = True, need_dw: bool = True):
    """``(dx, dweight)`` for 2-D ``x``/``dy`` (``None`` for what is not needed); ``dy`` is only read."""
    m, n = x.shape
    has_weight = weight is not None
    need_dw = need_dw and has_weight
    statics = dict(m=m, n=n, offset=offset, casting=casting, config=config, has_weight=has_weight)
    w_args = (weight,) if has_weight else ()
    params = backend.compiler_params(config.num_warps, config.num_stages, interpret=interpret)
    out_shape = []
    if need_dx:
        out_shape.append(jax.ShapeDtypeStruct((m, n), x.dtype))
    if need_dw:
        out_shape.append(jax.ShapeDtypeStruct((config.programs, n), F32))
    if not out_shape:
        return None, None
    bwd = functools.partial(_bwd_kernel, **statics, need_dx=need_dx, need_dw=need_dw)
    if config.resident(n):
        outs = pl.pallas_call(
            bwd, out_shape=tuple(out_shape), grid=(config.programs,), compiler_params=params,
            interpret=interpret, name="pallas_norm_bwd",
        )(x, *w_args, dy, rstd)
    else:
        sum_gx = pl.pallas_call(
            functools.partial(_bwd_rowsum_kernel, **statics),
            out_shape=jax.ShapeDtypeStruct((m,), F32), grid=(cdiv(m, config.block_rows),),
            compiler_params=params, interpret=interpret, name="pallas_norm_bwd_rowsum",
        )(x, *w_args, dy)
        outs = pl.pallas_call(
            bwd, out_shape=tuple(out_shape), grid=(config.programs, config.chunks(n)), compiler_params=params,
            interpret=interpret, name="pallas_norm_bwd_chunks",
        )(x, *w_args, dy, rstd, sum_gx)
    outs = list(outs)
    dx = outs.pop(0) if need_dx else None
    dweight = None
    if need_dw:
        dweight = pl.pallas_call(
            functools.partial(_dweight_reduce_kernel, n=n, parts=config.programs),
            out_shape=jax.ShapeDtypeStruct((n,), weight.dtype), grid=(cdiv(n, REDUCE_COLS),),
            compiler_params=backend.compiler_params(4, interpret=interpret), interpret=interpret,
            name="pallas_norm_dweight_reduce",
        )(outs.pop(0))
    return dx, dweight
