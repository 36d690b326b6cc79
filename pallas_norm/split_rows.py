"""Long rows split over co-resident programs (``Config.exchange``): x (and dy) read from memory once per pass.

A row of N columns is cut into ``P = config.chunks(n)`` column shares of ``block_cols``; each share is held in
registers by its own program of a persistent grid of ``config.programs = groups × P`` programs (program ``pid``
owns share ``pid % P`` of the row blocks ``pid // P``, ``+ groups``, …). A row's sum (``Σ x²`` forward, ``Σ g·x``
backward) is exchanged through global memory: each program posts its share's partial sum to the row's slot
``slots[row, share]`` (one atomic exchange of its float32 bits), then polls the row's slots (volatile loads) until
all are posted, and sums them in share order, so every program of the row, and every run, gets the same total.
The next row block's loads are issued before the wait (``prefetch``), and the backward adds its ``dweight`` terms
(which need only the forward's ``rstd``) before it, so the exchange's latency overlaps memory traffic.

The slots arrive filled with ``UNPOSTED`` (a NaN bit pattern float32 arithmetic never produces: posted NaNs are
the canonical one) and are aliased to an output, so XLA hands the kernel a fresh filled buffer per call. Nothing
here needs the grid to be co-resident to be correct: a program that polls ``spin_limit`` times without seeing every
share posted computes the missing partials itself from global memory, share by share with the owners' code (the
same bits), and does so for its remaining rows (it stops waiting). The interpreter runs programs one after the
other, so there all but a row's last program take that path (``spin_limit`` 1); on the GPU a grid of one program
per SM is co-resident and nobody waits long.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from . import backend, rowmath
from .kernels import F32, _dweight_reduce_kernel, _rstd, _span, _tile, _walk, _weight, REDUCE_COLS
from .pallas_config import Config, cdiv, next_pow2
from .rounding import rounder

UNPOSTED = -1  # int32 bits of a slot not yet posted (0xFFFFFFFF: a NaN payload no float32 arithmetic produces)
SPIN_LIMIT = 1 << 16  # polls before a program stops waiting for its peers (tens of ms on a GPU; never hit there)
INTERPRET_SPIN_LIMIT = 1


def _slot_cols(config: Config, n: int):
    parts = config.chunks(n)
    return jnp.arange(next_pow2(parts), dtype=jnp.int32), parts


class _Exchange:
    """One program's side of the row-sum exchange over ``slots`` ``(m, next_pow2(P))`` int32."""

    def __init__(self, slots_ref, config: Config, n: int, part, interpret: bool):
        self.slots, self.part, self.interpret = slots_ref, part, interpret
        self.spin_limit = INTERPRET_SPIN_LIMIT if interpret else SPIN_LIMIT
        self.pcols, self.parts = _slot_cols(config, n)
        self.pmask = self.pcols < self.parts

    def post(self, rows, rmask, partial):
        """Publish this share's partial sums ``(br,)`` of ``rows``."""
        partial = jnp.where(partial == partial, partial, F32(jnp.nan))  # one NaN pattern, never UNPOSTED
        bits = lax.bitcast_convert_type(partial, jnp.int32)
        col = jnp.full(rows.shape, self.part, jnp.int32)
        if self.interpret:  # programs run one after the other: a store is atomic (Pallas interprets no exchange)
            backend.store(self.slots.at[rows, col], bits, rmask)
        else:
            backend.atomic_xchg(self.slots, (rows, col), bits, rmask)

    def _poll(self, rows, rmask):
        mask = rmask[:, None] & self.pmask[None, :]
        return backend.load(self.slots.at[rows[:, None], self.pcols[None, :]], mask, other=0, volatile=True)

    def wait(self, rows, rmask, alone, own_partials):
        """``(total (br,), alone)``: the rows' sums over every share, from the posted slots, or, when they are not
        all posted within ``spin_limit`` polls (or this program already gave up on an earlier row: ``alone``), from
        ``own_partials(rows, rmask, share)`` for every share."""
        def ready(bits):
            return jnp.min(jnp.min(jnp.where(bits == UNPOSTED, 0, 1), axis=1)) == 1

        tries, bits = lax.while_loop(lambda s: ~alone & (s[0] < self.spin_limit) & ~ready(s[1]),
                                     lambda s: (s[0] + 1, self._poll(rows, rmask)),
                                     (jnp.int32(0), self._poll(rows, rmask)))
        alone = ~ready(bits)

        def gather(_):
            vals = jnp.zeros(bits.shape, F32)
            return lax.fori_loop(0, self.parts, lambda q, v: jnp.where(self.pcols[None, :] == q,
                                                                       own_partials(rows, rmask, q)[:, None], v), vals)

        parts = lax.cond(alone, gather, lambda b: lax.bitcast_convert_type(b, F32), bits)
        parts = jnp.where(self.pmask[None, :] & rmask[:, None], parts, F32(0))
        return jnp.sum(parts, axis=1), alone


def _fwd_kernel(*refs, m, n, eps, offset, casting, config: Config, has_weight, has_residual, interpret):
    """Refs: ``x, [residual], [weight], slots`` (aliased), outputs ``y, [h], rstd, slots``."""
    refs = list(refs)
    x_ref = refs.pop(0)
    res_ref = refs.pop(0) if has_residual else None
    w_ref = refs.pop(0) if has_weight else None
    refs.pop(0)  # the slots' input: the same buffer as the output ref below
    y_ref = refs.pop(0)
    h_ref = refs.pop(0) if has_residual else None
    rstd_ref, slots_ref = refs
    dt = y_ref.dtype
    br, bc = config.block_rows, config.block_cols
    parts = config.chunks(n)
    groups = config.programs // parts
    pid = pl.program_id(0)
    part, group = pid % parts, pid // parts
    ex = _Exchange(slots_ref, config, n, part, interpret)
    cols, cmask = _span(part * bc, bc, n)
    w_eff = None if config.reload_weight else _weight(w_ref, cols, cmask, offset, casting, dt)

    def row_values(rows, rmask, cols, cmask):
        x = _tile(x_ref, rows, rmask, cols, cmask)
        if res_ref is None:
            return x
        return rowmath.residual_add(x, _tile(res_ref, rows, rmask, cols, cmask), rounder(dt))

    def share_sumsq(rows, rmask, q):
        c, cm = _span(q * bc, bc, n)
        h32 = row_values(rows, rmask, c, cm)
        return jnp.sum(h32 * h32, axis=1)

    def rows_of(t):
        return _span((group + t * groups) * br, br, m)

    def fetch(t):
        rows, rmask = rows_of(t)
        x = _tile(x_ref, rows, rmask, cols, cmask, dtype=None)
        return x if res_ref is None else (x, _tile(res_ref, rows, rmask, cols, cmask, dtype=None))

    def use(t, tiles, alone):
        rows, rmask = rows_of(t)
        if res_ref is None:
            h32 = tiles.astype(F32)
        else:
            h32 = rowmath.residual_add(tiles[0].astype(F32), tiles[1].astype(F32), rounder(dt))
            backend.store(h_ref.at[rows[:, None], cols[None, :]], h32.astype(dt), rmask[:, None] & cmask[None, :])
        ex.post(rows, rmask, jnp.sum(h32 * h32, axis=1))
        total, alone = ex.wait(rows, rmask, alone, share_sumsq)
        rstd = _rstd(total, n, eps)
        n_val = rowmath.normalized(h32, rstd[:, None], casting, rounder(dt))
        w = _weight(w_ref, cols, cmask, offset, casting, dt) if config.reload_weight else w_eff
        y = rowmath.output(n_val, w).astype(dt)
        backend.store(y_ref.at[rows[:, None], cols[None, :]], y, rmask[:, None] & cmask[None, :])
        backend.store(rstd_ref.at[rows], rstd, rmask & (part == 0))
        return alone

    steps = cdiv(cdiv(m, br) - group, groups)
    _walk(steps, config.prefetch, fetch, use, jnp.bool_(False))


def _bwd_kernel(*refs, m, n, offset, casting, config: Config, has_weight, need_dx, need_dw, has_dh_out,
                interpret):
    """Refs: ``x, [weight], dy, [dh_out], rstd, slots`` (aliased), outputs ``[dx], [dweight partials (groups, n)],
    slots``."""
    refs = list(refs)
    x_ref = refs.pop(0)
    w_ref = refs.pop(0) if has_weight else None
    dy_ref = refs.pop(0)
    dh_ref = refs.pop(0) if has_dh_out else None
    rstd_ref = refs.pop(0)
    refs.pop(0)  # the slots' input
    dx_ref = refs.pop(0) if need_dx else None
    dwp_ref = refs.pop(0) if need_dw else None
    slots_ref = refs.pop(0)
    dt = dy_ref.dtype
    br, bc = config.block_rows, config.block_cols
    parts = config.chunks(n)
    groups = config.programs // parts
    pid = pl.program_id(0)
    part, group = pid % parts, pid // parts
    ex = _Exchange(slots_ref, config, n, part, interpret)
    cols, cmask = _span(part * bc, bc, n)
    w_eff = None if config.reload_weight else _weight(w_ref, cols, cmask, offset, casting, dt)

    def share_sum_gx(rows, rmask, q):
        c, cm = _span(q * bc, bc, n)
        w = _weight(w_ref, c, cm, offset, casting, dt)
        g = rowmath.grad_scale(_tile(dy_ref, rows, rmask, c, cm), w, casting, rounder(dt))
        return jnp.sum(g * _tile(x_ref, rows, rmask, c, cm), axis=1)

    def rows_of(t):
        return _span((group + t * groups) * br, br, m)

    def fetch(t):
        rows, rmask = rows_of(t)
        tiles = (_tile(x_ref, rows, rmask, cols, cmask, dtype=None), _tile(dy_ref, rows, rmask, cols, cmask, dtype=None),
                 backend.load(rstd_ref.at[rows], rmask))
        if dh_ref is not None:
            tiles += (_tile(dh_ref, rows, rmask, cols, cmask, dtype=None),)
        return tiles

    def use(t, tiles, carry):
        alone, dw_acc = carry
        rows, rmask = rows_of(t)
        x32, dy32, rstd = tiles[0].astype(F32), tiles[1].astype(F32), tiles[2][:, None]
        w = _weight(w_ref, cols, cmask, offset, casting, dt) if config.reload_weight else w_eff
        g = rowmath.grad_scale(dy32, w, casting, rounder(dt))
        if need_dx:
            ex.post(rows, rmask, jnp.sum(g * x32, axis=1))
        if need_dw:
            n_val = rowmath.normalized(x32, rstd, casting, rounder(dt))
            dw_acc = dw_acc + jnp.sum(rowmath.dweight_terms(dy32, n_val), axis=0)
        if need_dx:
            total, alone = ex.wait(rows, rmask, alone, share_sum_gx)
            dx = rowmath.grad_input(x32, g, rstd, total[:, None], F32(n))
            if dh_ref is not None:
                dx = rowmath.grad_residual(dx, tiles[3].astype(F32))
            backend.store(dx_ref.at[rows[:, None], cols[None, :]], dx.astype(dt), rmask[:, None] & cmask[None, :])
        return alone, dw_acc

    steps = cdiv(cdiv(m, br) - group, groups)
    _, dw = _walk(steps, config.prefetch, fetch, use, (jnp.bool_(False), jnp.zeros((bc,), F32)))
    if need_dw:
        backend.store(dwp_ref.at[group, cols], dw, cmask)


def _slots(m: int, config: Config, n: int):
    return jnp.full((m, next_pow2(config.chunks(n))), UNPOSTED, jnp.int32)


def forward(x, weight, *, eps: float, offset: float, casting: str, config: Config, interpret: bool,
            residual=None, h_dtype=None):
    """As ``kernels.forward``, for an exchange config (``config.exchange``)."""
    m, n = x.shape
    fused = residual is not None
    kernel = functools.partial(_fwd_kernel, m=m, n=n, eps=eps, offset=offset, casting=casting, config=config,
                               has_weight=weight is not None, has_residual=fused,
                               interpret=interpret)
    args = (x, *((residual,) if fused else ()), *(() if weight is None else (weight,)), _slots(m, config, n))
    row_dtype = h_dtype if fused else x.dtype
    slots = jax.ShapeDtypeStruct(args[-1].shape, jnp.int32)
    outs = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((m, n), row_dtype), *(jax.ShapeDtypeStruct((m, n), row_dtype),) * fused,
                   jax.ShapeDtypeStruct((m,), F32), slots),
        grid=(config.programs,), input_output_aliases={len(args) - 1: 2 + fused},
        compiler_params=backend.compiler_params(config.num_warps, config.num_stages, interpret=interpret),
        interpret=interpret, name="pallas_norm_add_fwd_split" if fused else "pallas_norm_fwd_split",
    )(*args)
    return outs[:-1]


def backward(x, weight, dy, rstd, *, offset: float, casting: str, config: Config, interpret: bool,
             need_dx: bool = True, need_dw: bool = True, dh_out=None):
    """As ``kernels.backward``, for an exchange config (``config.exchange``)."""
    m, n = x.shape
    has_weight = weight is not None
    need_dw = need_dw and has_weight
    if not (need_dx or need_dw):
        return None, None
    groups = config.programs // config.chunks(n)
    fused = dh_out is not None and need_dx
    kernel = functools.partial(_bwd_kernel, m=m, n=n, offset=offset, casting=casting, config=config,
                               has_weight=has_weight, need_dx=need_dx, need_dw=need_dw, has_dh_out=fused,
                               interpret=interpret)
    args = (x, *((weight,) if has_weight else ()), dy, *((dh_out,) if fused else ()), rstd, _slots(m, config, n))
    out_shape = [jax.ShapeDtypeStruct((m, n), x.dtype)] * need_dx
    out_shape += [jax.ShapeDtypeStruct((groups, n), F32)] * need_dw
    out_shape += [jax.ShapeDtypeStruct(args[-1].shape, jnp.int32)]
    params = backend.compiler_params(config.num_warps, config.num_stages, interpret=interpret)
    outs = list(pl.pallas_call(
        kernel, out_shape=tuple(out_shape), grid=(config.programs,),
        input_output_aliases={len(args) - 1: len(out_shape) - 1}, compiler_params=params, interpret=interpret,
        name="pallas_norm_add_bwd_split" if fused else "pallas_norm_bwd_split",
    )(*args))
    dx = outs.pop(0) if need_dx else None
    dweight = None
    if need_dw:
        dweight = pl.pallas_call(
            functools.partial(_dweight_reduce_kernel, n=n, parts=groups),
            out_shape=jax.ShapeDtypeStruct((n,), weight.dtype), grid=(cdiv(n, REDUCE_COLS),),
            compiler_params=backend.compiler_params(4, interpret=interpret), interpret=interpret,
            name="pallas_norm_dweight_reduce",
        )(outs.pop(0))
    return dx, dweight
