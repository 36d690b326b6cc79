"""Long rows split over co-resident programs (``Config.exchange``): x (and dy) read from memory once per pass.

A row of N columns is cut into ``P = config.chunks(n)`` column shares of ``block_cols``; each share is held in
registers by its own program of a persistent grid of ``config.programs = groups × P`` programs (program ``pid``
owns share ``pid % P`` of rows ``pid // P``, ``+ groups``, …). A row's sum (``Σ x²`` forward, ``Σ g·x``
backward) is exchanged through global memory: each program posts its share's partial sum (an atomic exchange of
its float32 bits into ``slots[row, share]``), then counts itself in (an atomic add to ``slots[row, S]``, ``S`` the
slot count); a program waiting for a row polls that counter (a scalar atomic: one value for the whole program) until
all P are in, then reads the P slots once and sums them in share order, so every program of the row, and every
run, gets the same total. The wait lags one row behind the post: a program posts row t, then waits for row t-1
and writes its outputs, so peers have a row's time to post; the next row's loads are in flight meanwhile
(``prefetch``).

The slots arrive filled with ``UNPOSTED`` (counters start there, at -1) and are aliased to an output, so XLA hands
the kernel a fresh filled buffer per call. Nothing here needs the grid to be co-resident to be correct: a program
that polls ``SPIN_LIMIT`` times without seeing a row complete computes the missing partials itself from global
memory, share by share with the owners' code (the same bits), and stops waiting for its later rows. The
interpreter runs programs one after the other, so there all but a row group's last program take that path.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from . import backend, rowmath
from .kernels import F32, REDUCE_COLS, _dweight_reduce_kernel, _rstd, _tile, _weight
from .pallas_config import Config, cdiv, next_pow2
from .rounding import rounder

UNPOSTED = -1  # int32 bits of a slot not yet posted (0xFFFFFFFF: a NaN payload no float32 arithmetic produces)
SPIN_LIMIT = 1 << 16  # polls before a program stops waiting for its peers (tens of ms on a GPU; never hit there)
INTERPRET_SPIN_LIMIT = 1


def slot_count(config: Config, n: int) -> int:
    """Slots per row: the shares' count padded to a power of two; one more column holds the row's counter."""
    return next_pow2(config.chunks(n))


class _Exchange:
    """One program's side of the row-sum exchange over ``slots`` ``(m, S + 1)`` int32."""

    def __init__(self, slots_ref, config: Config, n: int, part, interpret: bool):
        self.slots, self.part, self.interpret = slots_ref, part, interpret
        self.spin_limit = INTERPRET_SPIN_LIMIT if interpret else SPIN_LIMIT
        self.parts, self.count_col = config.chunks(n), slot_count(config, n)
        self.pcols = jnp.arange(self.count_col, dtype=jnp.int32)
        self.pmask = self.pcols < self.parts

    def post(self, row, ok, partial):
        """Publish this share's partial sum of ``row`` (when ``ok``), then count this share in."""
        partial = jnp.where(partial == partial, partial, F32(jnp.nan))  # one NaN pattern, never UNPOSTED
        bits = lax.bitcast_convert_type(partial, jnp.int32)

        @pl.when(ok)
        def _():
            if self.interpret:  # programs run one after the other: plain stores are atomic
                self.slots[row, self.part] = bits
                self.slots[row, self.count_col] = self.slots[row, self.count_col] + 1
            else:  # the slot, then the counter (release: whoever sees the count sees the slot)
                backend.atomic_xchg(self.slots, (row, self.part), bits)
                backend.atomic_add(self.slots, (row, self.count_col), jnp.int32(1))

    def _count(self, row):
        if self.interpret:
            return self.slots[row, self.count_col]
        return backend.atomic_add(self.slots, (row, self.count_col), jnp.int32(0))  # acquire; one value per program

    def wait(self, row, ok, alone, own_partial):
        """``(total, alone)``: ``row``'s sum over every share (0 unless ``ok``), from the posted slots once its
        counter says all are in, or, when that takes over ``spin_limit`` polls (or this program already gave up on
        an earlier row: ``alone``), from ``own_partial(row, ok, share)`` for every share."""
        done = lambda c: c == self.parts - 1  # noqa: E731  (counters start at UNPOSTED = -1)
        safe = jnp.where(ok, row, 0)
        _, count = lax.while_loop(lambda s: ok & ~alone & (s[0] < self.spin_limit) & ~done(s[1]),
                                  lambda s: (s[0] + 1, self._count(safe)), (jnp.int32(0), self._count(safe)))
        ready = done(count) | ~ok

        mask = (self.pmask & ok)[None, :]

        def posted(_):
            rows = jnp.full((1, 1), safe, jnp.int32)
            bits = backend.load(self.slots.at[rows, self.pcols[None, :]], mask, other=0, volatile=True)
            return lax.bitcast_convert_type(bits, F32)

        def recomputed(_):
            return lax.fori_loop(0, self.parts, lambda q, v: jnp.where(self.pcols[None, :] == q,
                                                                       own_partial(row, ok, q), v),
                                 jnp.zeros((1, self.count_col), F32))

        parts = lax.cond(ready, posted, recomputed, None)
        return _total(jnp.where(mask, parts, F32(0))), alone | ~ready


def _total(v):
    """Σ of a ``(1, k)`` tile (reduced one axis at a time)."""
    return jnp.sum(jnp.sum(v, axis=1))


def _pipeline(steps, prefetch: bool, fetch, start, finish, carry):
    """Row ``t`` of this program: ``carry = start(t, fetch(t), carry)`` (posts its partial), then
    ``carry = finish(t - 1, fetch(t - 1), carry)`` (waits for the previous row's total, writes its outputs) on the
    tiles fetched a step earlier (held in registers); the last row is finished after the loop. With ``prefetch``,
    ``fetch(t + 1)`` is issued before ``start(t, …)``."""
    def body(t, state):
        tiles, held, c = state
        nxt = fetch(t + 1) if prefetch else None
        tiles = tiles if prefetch else fetch(t)
        c = finish(t - 1, held, start(t, tiles, c))
        return nxt, tiles, c

    empty = jax.tree.map(jnp.zeros_like, fetch(0))  # what row -1 holds: never used (row -1 is not valid)
    _, held, carry = lax.fori_loop(0, steps, body, (fetch(0) if prefetch else None, empty, carry))
    return finish(steps - 1, held, carry)


def _place(config: Config, n: int, m: int):
    parts = config.chunks(n)
    groups = config.programs // parts
    pid = pl.program_id(0)
    part, group = pid % parts, pid // parts
    cols = part * config.block_cols + jnp.arange(config.block_cols, dtype=jnp.int32)
    steps = cdiv(m - group, groups)

    def row_of(t):
        row = group + t * groups
        return row, (t >= 0) & (row < m)

    return part, group, cols, cols < n, steps, row_of


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
    bc = config.block_cols
    part, _, cols, cmask, steps, row_of = _place(config, n, m)
    ex = _Exchange(slots_ref, config, n, part, interpret)
    w_eff = None if config.reload_weight else _weight(w_ref, cols, cmask, offset, casting, dt)

    def rows1(row, ok):
        return jnp.full((1,), row, jnp.int32), jnp.full((1,), ok)

    def values(raw):
        """The row values normalised, float32: x, or ``h = r_h(x + residual)``."""
        if res_ref is None:
            return raw.astype(F32)
        return rowmath.residual_add(raw[0].astype(F32), raw[1].astype(F32), rounder(dt))

    def load(row, ok, c, cm):
        rows, rmask = rows1(row, ok)
        x = _tile(x_ref, rows, rmask, c, cm, dtype=None)
        return x if res_ref is None else (x, _tile(res_ref, rows, rmask, c, cm, dtype=None))

    def share_sumsq(row, ok, q):
        c = q * bc + jnp.arange(bc, dtype=jnp.int32)
        h32 = values(load(row, ok, c, c < n))
        return _total(h32 * h32)

    def start(t, raw, alone):
        row, ok = row_of(t)
        h32 = values(raw)
        if h_ref is not None:
            rows, rmask = rows1(row, ok)
            backend.store(h_ref.at[rows[:, None], cols[None, :]], h32.astype(dt), rmask[:, None] & cmask[None, :])
        ex.post(row, ok, _total(h32 * h32))
        return alone

    def finish(t, raw, alone):
        row, ok = row_of(t)
        total, alone = ex.wait(row, ok, alone, share_sumsq)
        rstd = _rstd(total, n, eps)
        n_val = rowmath.normalized(values(raw), rstd, casting, rounder(dt))
        w = _weight(w_ref, cols, cmask, offset, casting, dt) if config.reload_weight else w_eff
        rows, rmask = rows1(row, ok)
        backend.store(y_ref.at[rows[:, None], cols[None, :]], rowmath.output(n_val, w).astype(dt),
                      rmask[:, None] & cmask[None, :])
        backend.store(rstd_ref.at[rows], jnp.full((1,), rstd), rmask & (part == 0))
        return alone

    _pipeline(steps, config.prefetch, lambda t: load(*row_of(t), cols, cmask), start, finish, jnp.bool_(False))


def _bwd_kernel(*refs, m, n, offset, casting, config: Config, has_weight, need_dx, need_dw, has_dh_out, interpret):
    """Refs: ``x, [weight], dy, [dh_out], rstd, slots`` (aliased), outputs ``[dx], [dweight partials (groups, n)],
    slots``. Without ``need_dx`` nothing is exchanged (``dweight`` needs only the forward's ``rstd``)."""
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
    bc = config.block_cols
    part, group, cols, cmask, steps, row_of = _place(config, n, m)
    ex = _Exchange(slots_ref, config, n, part, interpret)
    w_eff = None if config.reload_weight else _weight(w_ref, cols, cmask, offset, casting, dt)

    def own_weight():
        return _weight(w_ref, cols, cmask, offset, casting, dt) if config.reload_weight else w_eff

    def load(row, ok, c, cm, with_dh=False):
        rows, rmask = jnp.full((1,), row, jnp.int32), jnp.full((1,), ok)
        tiles = (_tile(x_ref, rows, rmask, c, cm, dtype=None), _tile(dy_ref, rows, rmask, c, cm, dtype=None))
        if with_dh:
            tiles += (_tile(dh_ref, rows, rmask, c, cm, dtype=None),)
        return tiles

    def grad_scale(raw, w):
        x32, dy32 = raw[0].astype(F32), raw[1].astype(F32)
        return x32, dy32, rowmath.grad_scale(dy32, w, casting, rounder(dt))

    def share_sum_gx(row, ok, q):
        c = q * bc + jnp.arange(bc, dtype=jnp.int32)
        x32, _, g = grad_scale(load(row, ok, c, c < n), _weight(w_ref, c, c < n, offset, casting, dt))
        return _total(g * x32)

    def fetch(t):
        row, ok = row_of(t)
        rstd = backend.load(rstd_ref.at[jnp.full((1,), row, jnp.int32)], jnp.full((1,), ok))
        return (*load(row, ok, cols, cmask, with_dh=dh_ref is not None and need_dx), rstd)

    def start(t, raw, carry):
        alone, dw = carry
        row, ok = row_of(t)
        x32, dy32, g = grad_scale(raw, own_weight())
        if need_dx:
            ex.post(row, ok, _total(g * x32))
        if need_dw:
            n_val = rowmath.normalized(x32, raw[-1][:, None], casting, rounder(dt))
            dw = dw + jnp.sum(rowmath.dweight_terms(dy32, n_val), axis=0)
        return alone, dw

    def finish(t, raw, carry):
        alone, dw = carry
        if not need_dx:
            return carry
        row, ok = row_of(t)
        total, alone = ex.wait(row, ok, alone, share_sum_gx)
        x32, _, g = grad_scale(raw, own_weight())
        dx = rowmath.grad_input(x32, g, raw[-1][:, None], total, F32(n))
        if dh_ref is not None:
            dx = rowmath.grad_residual(dx, raw[2].astype(F32))
        rows, rmask = jnp.full((1,), row, jnp.int32), jnp.full((1,), ok)
        backend.store(dx_ref.at[rows[:, None], cols[None, :]], dx.astype(dt), rmask[:, None] & cmask[None, :])
        return alone, dw

    _, dw = _pipeline(steps, config.prefetch, fetch, start, finish, (jnp.bool_(False), jnp.zeros((bc,), F32)))
    if need_dw:
        backend.store(dwp_ref.at[group, cols], dw, cmask)


def _slots(m: int, config: Config, n: int):
    return jnp.full((m, slot_count(config, n) + 1), UNPOSTED, jnp.int32)


def forward(x, weight, *, eps: float, offset: float, casting: str, config: Config, interpret: bool,
            residual=None, h_dtype=None):
    """As ``kernels.forward``, for an exchange config (``config.exchange``)."""
    m, n = x.shape
    fused = residual is not None
    kernel = functools.partial(_fwd_kernel, m=m, n=n, eps=eps, offset=offset, casting=casting, config=config,
                               has_weight=weight is not None, has_residual=fused, interpret=interpret)
    args = (x, *((residual,) if fused else ()), *(() if weight is None else (weight,)), _slots(m, config, n))
    row_dtype = h_dtype if fused else x.dtype
    outs = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((m, n), row_dtype), *(jax.ShapeDtypeStruct((m, n), row_dtype),) * fused,
                   jax.ShapeDtypeStruct((m,), F32), jax.ShapeDtypeStruct(args[-1].shape, jnp.int32)),
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
