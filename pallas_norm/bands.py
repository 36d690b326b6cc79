"""Long rows on column bands (``Config.lag``): x (and dy) read from memory once, row sums exchanged.

The grid is ``P = config.chunks(n)`` bands × ``G = groups(config, n)`` row groups: program ``(p, g)`` owns band p
(``block_cols`` columns) of the rows of group g, which it walks in blocks of ``block_rows`` (blocks g, g + G, ...;
a group's P programs must be co-resident to run at speed). At step ``t`` it loads its t-th block's band from memory
(kept in L2: ``evict_last``) and posts each row's partial sum over the band to ``slots[row, band]`` (the forward:
``Σ x²``; the backward: ``Σ g·x``, and it accumulates its band's ``dweight``); then it finishes its block ``t - lag``:
reads that block's ``P`` slots, sums them in band order (every program, every run: the same total), loads the
block's band again (``lag`` blocks later: L1 or L2), or with ``config.carry`` takes it from registers (the last
``lag`` blocks carried through the loop), and writes the block's band of y (and rstd, band 0's program) or dx. So
memory sees each row operand read once and each result written once (the forward 2 passes where the chunked path
makes 3, the backward 3 for 5); ``dweight`` is each band's sum over its group's rows, in row order, stored by its
owner (one group) or summed over the groups in group order (``dweight.reduce_dweight``): deterministic.

The exchange (``band_slots``): slots filled per call, posted by one 32-bit store, polled by volatile loads.
Groups never wait on each other: a group that does not fit beside the others runs in a later wave. Nothing needs a
group co-resident to be correct: a program that waits too long for a block's slots computes the missing partials
itself (the same bits) and from then on never waits. The interpreter runs programs one after another, so there
every program but the last of a group takes that path. A group that is not co-resident (more bands than the GPU
holds at once, or SMs taken by other streams' kernels) is therefore correct but slow: the heuristics ask at most
``BANDS_MAX_PER_SM`` bands per SM of one-warp programs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from . import backend, band_slots, band_tables, rowmath
from .band_slots import groups
from .dweight import reduce_dweight
from .kernels import _bwd_inputs
from .pallas_config import Config, cdiv
from .rounding import rounder
from .tiles import F32, _grad, _rstd, _span, _weight_of, grad_in_dtype


def _own_band(w_ref, n: int, config: Config, offset: float, casting: str, dt, low: bool = False, full: bool = False):
    """This program's band: ``(band index, cols, cmask, w_eff over the band)`` (``tiles._weight_of``); ``full``
    (``_full_walk``): a constant ``cmask``, which Triton drops from the loads and stores."""
    pid, bc = pl.program_id(0), config.block_cols
    cols, cmask = _span(pid * bc, bc, n)
    if full:
        cmask = jnp.full((bc,), True)
    return pid, cols, cmask, _weight_of(w_ref, cols, cmask, offset, casting, dt, low)


def _first_read(config: Config, unhinted: bool = False) -> str | None:
    """The cache policy of a band's first read: kept in L2 for the second (``evict_last``), or streamed when the
    tiles are carried to their finish (``evict_first``); ``unhinted``: none (the fused add's backward with g in the
    row dtype, up to ``band_tables.ADD_BWD_UNHINTED_MAX_COLS`` columns: faster there, measured)."""
    return "evict_first" if config.carry else None if unhinted else "evict_last"


def _enqueue(queue: tuple, tiles) -> tuple:
    """The carried blocks after step t: block t's tiles first, block t - lag's (finished at step t) dropped."""
    return (tiles, *queue[:-1])


def _full_walk(m: int, n: int, config: Config, *, add_backward: bool = False) -> bool:
    """Whether a band kernel walks full blocks (``_walk_bands``' ``full``) with a constant column mask
    (``_own_band``'s): ``band_tables.full_blocks`` (every block and band full; for the fused add's backward at most
    ``FULL_WALK_ADD_BWD_MAX_BANDS`` bands: slower beyond, measured)."""
    return band_tables.full_blocks(m, n, config.block_rows, config.block_cols, groups(config, n),
                                   add_backward=add_backward)


def _walk_bands(m: int, n: int, config: Config, lag: int, rows_of, fetch, start, finish, ex,
                acc_cols: int | None = None, *, full: bool = False):
    """``acc = start(rows(t), fetch(rows(t)), acc)`` for every row block t (``rows(t)``: ``(rows, mask)``, from
    ``rows_of``; ``acc``: float32 zeros of ``(acc_cols,)`` at first, None without ``acc_cols``), and
    ``finish(t - lag, rows(t - lag), tiles, posted, alone)`` after it (``lag`` 0: no finishing; ``tiles``: block
    t - lag's, carried in registers since its fetch with ``config.carry``, else None: finish loads them again); block
    t - lag's slots are read before block t's math (in flight meanwhile). With ``config.prefetch`` block t + 1 is
    fetched first. With ``full`` (``_full_walk``; prefetching, read again, some lag) three loops: the first
    lag blocks started, the steady state with constant row masks (unmasked loads and stores: no zero fill), the last
    lag blocks finished; the same bits as one masked loop (what it skips adds zeros). Returns ``acc``."""
    carry = config.carry and lag > 0
    steps = cdiv(cdiv(m, config.block_rows), groups(config, n))
    acc = None if acc_cols is None else jnp.zeros((acc_cols,), F32)
    if full and not carry and band_tables.walks_full_blocks(steps, lag, config.prefetch):
        return _walk_full_blocks(steps, lag, rows_of, fetch, start, finish, ex, acc)

    def body(t, state):
        tiles, queue, acc, alone = state
        nxt = fetch(rows_of(t + 1)) if config.prefetch else None
        if not config.prefetch:
            tiles = fetch(rows_of(t))
        posted = ex.read(t - lag) if lag else None
        acc = start(rows_of(t), tiles, acc)
        if lag:
            alone = finish(t - lag, rows_of(t - lag), queue[-1] if carry else None, posted, alone)
        return nxt, _enqueue(queue, tiles) if carry else (), acc, alone

    first = fetch(rows_of(0)) if config.prefetch else None
    zeros = jax.tree.map(jnp.zeros_like, first if config.prefetch else fetch(rows_of(0))) if carry else None
    queue = (zeros,) * lag if carry else ()  # blocks -lag .. -1: never finished
    return lax.fori_loop(0, steps + lag, body, (first, queue, acc, jnp.bool_(False)))[2]


def _walk_full_blocks(steps: int, lag: int, rows_of, fetch, start, finish, ex, acc):
    """``_walk_bands`` where every block is full, prefetching: blocks 0 .. lag - 1 started (nothing to finish),
    lag .. steps - 1 started and block t - lag finished (the prefetch of block steps clamped to steps - 1: read, not
    used), then the last lag blocks finished; row masks constant (Triton drops them)."""

    def full(t):
        rows, _ = rows_of(t)
        return rows, jnp.full(rows.shape, True)

    def head(t, state):
        tiles, acc = state
        return fetch(full(t + 1)), start(full(t), tiles, acc)

    def steady(t, state):
        tiles, acc, alone = state
        nxt = fetch(full(jnp.minimum(t + 1, steps - 1)))
        posted = ex.read(t - lag)
        acc = start(full(t), tiles, acc)
        return nxt, acc, finish(t - lag, full(t - lag), None, posted, alone)

    def tail(t, state):
        acc, alone = state
        posted = ex.read(t - lag)
        return acc, finish(t - lag, full(t - lag), None, posted, alone)

    tiles, acc = lax.fori_loop(0, lag, head, (fetch(full(0)), acc))
    _, acc, alone = lax.fori_loop(lag, steps, steady, (tiles, acc, jnp.bool_(False)))
    return lax.fori_loop(steps, steps + lag, tail, (acc, alone))[0]


def _fwd_kernel(*refs, m, n, eps, offset, casting, config: Config, has_weight, has_residual, interpret):
    """Refs: ``x, [residual], [weight], slots`` in, ``y, [h], rstd, slots`` out (the slots aliased). The fused add
    (``has_residual``) posts ``Σ h²`` of ``h = r_h(x + residual)`` and adds again at the finish (both reads of x
    and residual: the same h)."""
    refs = list(refs)
    x_ref = refs.pop(0)
    res_ref = refs.pop(0) if has_residual else None
    w_ref = refs.pop(0) if has_weight else None
    refs.pop(0)  # the slots' input: the same buffer as the output ref
    y_ref = refs.pop(0)
    h_ref = refs.pop(0) if has_residual else None
    rstd_ref, slots_ref = refs
    dt = y_ref.dtype
    full = _full_walk(m, n, config)
    pid, cols, cmask, w_eff = _own_band(w_ref, n, config, offset, casting, dt, full=full)

    def band(rows, rmask, c, cm, policy):
        mask = rmask[:, None] & cm[None, :]
        x = backend.load(x_ref.at[rows[:, None], c[None, :]], mask, eviction=policy)
        return x if res_ref is None else (x, backend.load(res_ref.at[rows[:, None], c[None, :]], mask, eviction=policy))

    def row(tiles):
        """The row values normalised, float32: x, or ``h = r_h(x + residual)`` (h's dtype is y's)."""
        if res_ref is None:
            return tiles.astype(F32)
        return rowmath.residual_add(tiles[0].astype(F32), tiles[1].astype(F32), rounder(dt))

    def partial_sq(rows, rmask, c, cm):
        h32 = row(band(rows, rmask, c, cm, None))
        return jnp.sum(h32 * h32, axis=1)

    rows_of = band_slots.block_rows_of(m, n, config)
    ex = band_slots.exchange(slots_ref, partial_sq, rows_of, n=n, config=config, interpret=interpret)

    def fetch(rr):
        return band(*rr, cols, cmask, _first_read(config))

    def start(rr, tiles, acc):
        rows, rmask = rr
        h32 = row(tiles)
        ex.post(rows, rmask, jnp.sum(h32 * h32, axis=1))
        return acc

    def finish(u, rr, tiles, posted, alone):
        rows, rmask = rr
        tiles = band(rows, rmask, cols, cmask, "evict_first") if tiles is None else tiles
        total, alone = ex.totals(u, posted, alone)
        rstd = _rstd(total, n, eps)
        h32 = row(tiles)
        mask = rmask[:, None] & cmask[None, :]
        if h_ref is not None:
            backend.store(h_ref.at[rows[:, None], cols[None, :]], h32.astype(dt), mask)
        y = rowmath.output(rowmath.normalized(h32, rstd[:, None], casting, rounder(dt)), w_eff)
        backend.store(y_ref.at[rows[:, None], cols[None, :]], y.astype(dt), mask)
        backend.store(rstd_ref.at[rows], rstd, rmask & (pid == 0))
        return alone

    _walk_bands(m, n, config, max(config.lag, 1), rows_of, fetch, start, finish, ex, full=full)


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
    bc = config.block_cols
    # ``low``: g = r(dy·w_eff) as one multiply of two values of the row dtype (one bf16x2/f16x2 instruction per pair,
    # the float32 product's bits: the same dx), as ``kernels._bwd_kernel`` does for rms_norm's rows it holds, here for
    # the fused add's too (its dweight does not involve g). The band backward is bound by its instruction stream
    # (``ncu`` on an H200: DRAM 69% busy, the issue slots half used by 8 one-warp programs per SM; probes fifty-second
    # session §4); the float32 product took a multiply, a rounding and a widening per element, twice.
    low = grad_in_dtype(None if w_ref is None else w_ref.dtype, dt, casting, offset)
    full = _full_walk(m, n, config, add_backward=has_dh_out)
    pid, cols, cmask, w_eff = _own_band(w_ref, n, config, offset, casting, dt, low, full)
    # bf16 rows compiled: widened and rounded as pairs (the same bits), dweight's and dx's multiply-adds fused (one
    # rounding; ``backend.RowOps``). H200, 8192×32768-1024×262144, Llama and Gemma, plain and fused add: +1.9-4.5%;
    # neither alone (pairs -2.8% to +3.4%, fma -2.9% to +0.6%; fifty-third session). fp16 (no pairs): the fma alone
    # -0.7% to +0.9%, left out.
    ops = backend.row_ops(dt, interpret=interpret)
    first_read = _first_read(config, has_dh_out and band_tables.add_bwd_unhinted(n, jnp.dtype(dt).name, low))

    def band(rows, rmask, c, cm, policy):
        return (backend.load(x_ref.at[rows[:, None], c[None, :]], rmask[:, None] & cm[None, :], eviction=policy),
                backend.load(dy_ref.at[rows[:, None], c[None, :]], rmask[:, None] & cm[None, :], eviction=policy))

    def sum_gx(x_raw, dy_raw, w):
        """Each row's ``Σ g·x`` over one band (float32, ``(block_rows,)``)."""
        return jnp.sum(_grad(dy_raw, w, casting, dt, low, ops=ops) * ops.widen(x_raw), axis=1)

    def partial_gx(rows, rmask, c, cm):
        """A peer band's rows' ``Σ g·x``, computed here (``band_slots``' fallback: the owner's code, the same bits)."""
        return sum_gx(*band(rows, rmask, c, cm, None), _weight_of(w_ref, c, cm, offset, casting, dt, low))

    rows_of = band_slots.block_rows_of(m, n, config)
    ex = (band_slots.exchange(slots_ref, partial_gx, rows_of, n=n, config=config, interpret=interpret)
          if need_dx else None)

    def fetch(rr):
        """A row block's band of x and dy, and its rstd, from memory (kept in L2 for a second read)."""
        rows, rmask = rr
        return (*band(rows, rmask, cols, cmask, first_read), backend.load(rstd_ref.at[rows], rmask))

    def start(rr, tiles, dw):
        """A row block: its ``dweight`` terms, and its rows' partial sums posted."""
        x_raw, dy_raw, rstd = tiles
        rows, rmask = rr
        if need_dw:
            dy32, n_val = ops.widen(dy_raw), rowmath.normalized(ops.widen(x_raw), rstd[:, None], casting, ops.round)
            if ops.fused and config.block_rows == 1:
                dw = ops.mul_add(dy32[0], n_val[0], dw)  # rowmath.dweight_terms, fused into the sum
            else:
                dw = dw + jnp.sum(rowmath.dweight_terms(dy32, n_val), axis=0)
        if need_dx:
            ex.post(rows, rmask, sum_gx(x_raw, dy_raw, w_eff))
        return dw

    def finish(u, rr, tiles, posted, alone):
        """Block ``u``: its ``dx`` from the band (carried, or read again: L1 or L2) and the rows' totals."""
        rows, rmask = rr
        if tiles is None:
            x_raw, dy_raw = band(rows, rmask, cols, cmask, "evict_first")
            rstd = backend.load(rstd_ref.at[rows], rmask)
        else:
            x_raw, dy_raw, rstd = tiles
        rstd = rstd[:, None]
        total, alone = ex.totals(u, posted, alone)
        dx = rowmath.grad_input(ops.widen(x_raw), _grad(dy_raw, w_eff, casting, dt, low, ops=ops), rstd,
                                total[:, None], F32(n), ops.mul_add if ops.fused else None)
        tile_mask = rmask[:, None] & cmask[None, :]
        if dh_ref is not None:
            dx = rowmath.grad_residual(dx, ops.widen(backend.load(dh_ref.at[rows[:, None], cols[None, :]], tile_mask)))
        backend.store(dx_ref.at[rows[:, None], cols[None, :]], dx.astype(dt), tile_mask)
        return alone

    dw = _walk_bands(m, n, config, config.lag if need_dx else 0, rows_of, fetch, start, finish, ex, bc, full=full)
    if need_dw and len(dw_ref.shape) == 1:  # one row group: this band's dweight itself
        backend.store(dw_ref.at[cols], dw.astype(dw_ref.dtype), cmask)
    elif need_dw:  # the group's partial, summed in group order by reduce_dweight
        backend.store(dw_ref.at[pl.program_id(1), cols], dw, cmask)


def forward(x, weight, *, eps: float, offset: float, casting: str, config: Config, interpret: bool,
            residual=None, h_dtype=None):
    """As ``kernels.forward``, for a band config (``config.lag``; a forward finishes at least one block late):
    one launch, rstd stored by band 0's program."""
    m, n = x.shape
    fused = residual is not None
    kernel = functools.partial(_fwd_kernel, m=m, n=n, eps=eps, offset=offset, casting=casting, config=config,
                               has_weight=weight is not None, has_residual=fused, interpret=interpret)
    args = (x, *((residual,) if fused else ()), *(() if weight is None else (weight,)), band_slots.slots(m, n, config))
    row = jax.ShapeDtypeStruct((m, n), h_dtype if fused else x.dtype)
    out_shape = (row, *(row,) * fused, jax.ShapeDtypeStruct((m,), F32), jax.ShapeDtypeStruct(args[-1].shape, jnp.int32))
    outs = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(config.chunks(n), groups(config, n)),
        input_output_aliases={len(args) - 1: len(out_shape) - 1},
        compiler_params=backend.compiler_params(config.num_warps, config.num_stages, interpret=interpret),
        interpret=interpret, name="pallas_norm_add_fwd_bands" if fused else "pallas_norm_fwd_bands",
    )(*args)
    return outs[:-1]


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
    g = groups(config, n)
    out_shape = [jax.ShapeDtypeStruct((m, n), x.dtype)] * need_dx
    out_shape += [jax.ShapeDtypeStruct((n,), weight.dtype) if g == 1 else jax.ShapeDtypeStruct((g, n), F32)] * need_dw
    aliases = {}
    if need_dx:
        args.append(band_slots.slots(m, n, config))
        out_shape.append(jax.ShapeDtypeStruct(args[-1].shape, jnp.int32))
        aliases = {len(args) - 1: len(out_shape) - 1}
    outs = list(pl.pallas_call(
        kernel, out_shape=tuple(out_shape), grid=(config.chunks(n), g), input_output_aliases=aliases,
        compiler_params=backend.compiler_params(config.num_warps, config.num_stages, interpret=interpret),
        interpret=interpret, name="pallas_norm_add_bwd_bands" if fused else "pallas_norm_bwd_bands",
    )(*args))
    dx = outs.pop(0) if need_dx else None
    dweight = outs.pop(0) if need_dw else None
    if need_dw and g > 1:
        dweight = reduce_dweight(dweight, weight.dtype, interpret=interpret)
    return dx, dweight
