"""The long-row backward that reads x and dy from memory once (``Config.lag``): column bands, row sums exchanged.

Each of ``P = config.chunks(n)`` programs owns one band of ``block_cols`` columns of every row (the grid must be
co-resident: ``P`` at most the GPU's resident programs) and walks the rows in blocks of ``block_rows``. At step
``t`` it loads block ``t``'s band of x and dy from memory (kept in L2: ``evict_last``), accumulates its band's
``dweight`` and posts each row's partial ``Σ g·x`` to ``slots[row, band]``; then it finishes block ``t - lag``:
reads that block's ``P`` slots, sums them in band order (every program, every run: the same total), loads the
block's band again (from L2, ``lag`` blocks later) and writes ``dx``. So memory sees x and dy read once and dx
written once (3 passes where the chunked path makes 5), and ``dweight`` needs no partials: each band's sum over
rows, in row order, is stored by its owner (deterministic).

The slots arrive filled with ``UNPOSTED`` (an int32 NaN payload no float32 arithmetic produces; a NaN partial is
posted as the canonical NaN) and are aliased to an output, so XLA (or the torch launch route) hands the kernel a
fresh filled buffer per call. A slot is one 32-bit store, read by volatile loads: a posted value is its own flag,
no fence or atomic needed. Nothing needs the grid co-resident to be correct: a program that polls ``SPIN_LIMIT``
times without seeing a block's slots complete computes the missing partials itself from memory with the owners'
code (the same bits; only the missing bands' rows are read) and from then on never waits (later blocks: what is
posted, the rest computed). The interpreter runs programs one after another, so there every program but the last
takes that path. A grid that is not co-resident (more bands than the GPU holds at once, or SMs taken by other
streams' kernels) is therefore correct but slow: the heuristic asks at most two 4-warp programs per SM.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from . import backend, rowmath
from .kernels import F32, _bwd_inputs, _span, _weight
from .pallas_config import Config, cdiv, next_pow2
from .rounding import rounder

UNPOSTED = -1  # int32 bits of a slot not yet posted (0xFFFFFFFF)
SPIN_LIMIT = 1 << 14  # polls of a block's slots before a program stops waiting (milliseconds; never hit on a GPU)
INTERPRET_SPIN_LIMIT = 0


def slot_cols(config: Config, n: int) -> int:
    """Slots per row: the band count padded to a power of two (the padding is never posted nor read)."""
    return next_pow2(config.chunks(n))


def _rows(t, br: int, m: int):
    rows, rmask = _span(t * br, br, m)
    return rows, rmask & (t >= 0)


def _bwd_kernel(*refs, m, n, offset, casting, config: Config, has_weight, need_dx, need_dw, has_dh_out, interpret):
    """Refs: ``x, [weight], dy, [dh_out], rstd, [slots]``, outputs ``[dx], [dweight (n,)], [slots]`` (the slots,
    aliased, only with ``need_dx``: ``dweight`` alone needs no row sums)."""
    refs = list(refs)
    x_ref, w_ref, dy_ref, dh_ref, rstd_ref = _bwd_inputs(refs, has_weight, has_dh_out)
    if need_dx:
        refs.pop(0)  # the slots' input: the same buffer as the output ref
    dx_ref = refs.pop(0) if need_dx else None
    dw_ref = refs.pop(0) if need_dw else None
    slots_ref = refs.pop(0) if need_dx else None
    dt = dy_ref.dtype
    br, bc, parts, lag = config.block_rows, config.block_cols, config.chunks(n), config.lag if need_dx else 0
    pid = pl.program_id(0)
    cols, cmask = _span(pid * bc, bc, n)
    w_eff = _weight(w_ref, cols, cmask, offset, casting, dt)
    pcols = jnp.arange(slot_cols(config, n), dtype=jnp.int32)
    pmask = pcols < parts
    spin_limit = INTERPRET_SPIN_LIMIT if interpret else SPIN_LIMIT

    def band(rows, rmask, c, cm, policy):
        return (backend.load(x_ref.at[rows[:, None], c[None, :]], rmask[:, None] & cm[None, :], eviction=policy),
                backend.load(dy_ref.at[rows[:, None], c[None, :]], rmask[:, None] & cm[None, :], eviction=policy))

    def partial_gx(x_raw, dy_raw, w):
        """Each row's ``Σ g·x`` over one band (float32, ``(block_rows,)``)."""
        x32, dy32 = x_raw.astype(F32), dy_raw.astype(F32)
        return jnp.sum(rowmath.grad_scale(dy32, w, casting, rounder(dt)) * x32, axis=1)

    def fetch(t):
        """Block ``t``'s band of x and dy, and its rstd, from memory (kept in L2 for the second read)."""
        rows, rmask = _rows(t, br, m)
        return (*band(rows, rmask, cols, cmask, "evict_last"), backend.load(rstd_ref.at[rows], rmask))

    def start(t, tiles, dw):
        """Block ``t``: its ``dweight`` terms, and its rows' partial sums posted."""
        x_raw, dy_raw, rstd = tiles
        rows, rmask = _rows(t, br, m)
        if need_dw:
            n_val = rowmath.normalized(x_raw.astype(F32), rstd[:, None], casting, rounder(dt))
            dw = dw + jnp.sum(rowmath.dweight_terms(dy_raw.astype(F32), n_val), axis=0)
        if need_dx:
            part = partial_gx(x_raw, dy_raw, w_eff)
            bits = lax.bitcast_convert_type(jnp.where(part == part, part, F32(jnp.nan)), jnp.int32)
            backend.store(slots_ref.at[rows[:, None], jnp.full((1, 1), pid, jnp.int32)], bits[:, None], rmask[:, None])
        return dw

    def slots(rows, mask):
        return backend.load(slots_ref.at[rows[:, None], pcols[None, :]], mask, other=0, volatile=True)

    def totals(u, posted, alone):
        """``(Σ g·x of block u's rows, alone)``: from the posted slots once all are in, else (after ``spin_limit``
        polls, or once this program has given up on an earlier block) recomputed band by band."""
        rows, rmask = _rows(u, br, m)
        mask = rmask[:, None] & pmask[None, :]

        def complete(bits):  # (jnp.all has no Triton lowering: a min over int32, one axis at a time)
            return jnp.min(jnp.min(jnp.where((bits != UNPOSTED) | ~mask, 1, 0), axis=1)) == 1

        _, posted = lax.while_loop(lambda s: ~alone & (s[0] < spin_limit) & ~complete(s[1]),
                                   lambda s: (s[0] + 1, slots(rows, mask)), (jnp.int32(0), posted))
        ready = complete(posted)

        def recomputed(_):
            """The posted partials, and the missing ones computed here (only their bands' rows are read)."""
            missing = (posted == UNPOSTED) & mask

            def one(q, acc):
                c, cm = _span(q * bc, bc, n)
                rows_q = jnp.max(jnp.where(missing & (pcols[None, :] == q), 1, 0), axis=1) == 1
                part = partial_gx(*band(rows, rows_q, c, cm, None), _weight(w_ref, c, cm, offset, casting, dt))
                return jnp.where(missing & (pcols[None, :] == q), part[:, None], acc)

            return lax.fori_loop(0, parts, one, lax.bitcast_convert_type(posted, F32))

        vals = lax.cond(ready, lambda _: lax.bitcast_convert_type(posted, F32), recomputed, None)
        return jnp.sum(jnp.where(mask, vals, F32(0)), axis=1), alone | ~ready

    def finish(u, posted, alone):
        """Block ``u``: its ``dx`` from the band read again (L2) and the rows' totals."""
        rows, rmask = _rows(u, br, m)
        x_raw, dy_raw = band(rows, rmask, cols, cmask, "evict_first")
        rstd = backend.load(rstd_ref.at[rows], rmask)[:, None]
        total, alone = totals(u, posted, alone)
        x32, dy32 = x_raw.astype(F32), dy_raw.astype(F32)
        dx = rowmath.grad_input(x32, rowmath.grad_scale(dy32, w_eff, casting, rounder(dt)), rstd, total[:, None],
                                F32(n))
        tile_mask = rmask[:, None] & cmask[None, :]
        if dh_ref is not None:
            dx = rowmath.grad_residual(dx, backend.load(dh_ref.at[rows[:, None], cols[None, :]], tile_mask).astype(F32))
        backend.store(dx_ref.at[rows[:, None], cols[None, :]], dx.astype(dt), tile_mask)
        return alone

    def body(t, state):
        tiles, dw, alone = state
        nxt = fetch(t + 1) if config.prefetch else None
        if not config.prefetch:
            tiles = fetch(t)
        if need_dx:  # block t - lag's slots, read before block t's math (in flight meanwhile)
            rows, rmask = _rows(t - lag, br, m)
            posted = slots(rows, rmask[:, None] & pmask[None, :])
        dw = start(t, tiles, dw)
        if need_dx:
            alone = finish(t - lag, posted, alone)
        return nxt, dw, alone

    first = fetch(0) if config.prefetch else None
    _, dw, _ = lax.fori_loop(0, cdiv(m, br) + lag, body, (first, jnp.zeros((bc,), F32), jnp.bool_(False)))
    if need_dw:
        backend.store(dw_ref.at[cols], dw.astype(dw_ref.dtype), cmask)


def backward(x, weight, dy, rstd, *, offset: float, casting: str, config: Config, interpret: bool,
             need_dx: bool = True, need_dw: bool = True, dh_out=None):
    """As ``kernels.backward``, for a band config (``config.lag``): one launch, ``dweight`` stored by its bands'
    owners."""
    m, n = x.shape
    has_weight = weight is not None
    need_dw = need_dw and has_weight
    if not (need_dx or need_dw):
        return None, None
    fused = dh_out is not None and need_dx
    kernel = functools.partial(_bwd_kernel, m=m, n=n, offset=offset, casting=casting, config=config,
                               has_weight=has_weight, need_dx=need_dx, need_dw=need_dw, has_dh_out=fused,
                               interpret=interpret)
    args = [x, *((weight,) if has_weight else ()), dy, *((dh_out,) if fused else ()), rstd]
    out_shape = [jax.ShapeDtypeStruct((m, n), x.dtype)] * need_dx
    out_shape += [jax.ShapeDtypeStruct((n,), weight.dtype)] * need_dw
    aliases = {}
    if need_dx:
        args.append(jnp.full((m, slot_cols(config, n)), UNPOSTED, jnp.int32))
        out_shape.append(jax.ShapeDtypeStruct(args[-1].shape, jnp.int32))
        aliases = {len(args) - 1: len(out_shape) - 1}
    outs = list(pl.pallas_call(
        kernel, out_shape=tuple(out_shape), grid=(config.chunks(n),), input_output_aliases=aliases,
        compiler_params=backend.compiler_params(config.num_warps, config.num_stages, interpret=interpret),
        interpret=interpret, name="pallas_norm_add_bwd_bands" if fused else "pallas_norm_bwd_bands",
    )(*args))
    dx = outs.pop(0) if need_dx else None
    dweight = outs.pop(0) if need_dw else None
    return dx, dweight
