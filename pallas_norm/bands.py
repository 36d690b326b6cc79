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
owner (one group) or summed over the groups in group order (``kernels.reduce_dweight``): deterministic.

The slots arrive filled with ``UNPOSTED`` (an int32 NaN payload no float32 arithmetic produces; a NaN partial is
posted as the canonical NaN) and are aliased to an output, so XLA (or the torch launch route) hands the kernel a
fresh filled buffer per call (``slot_width`` slots per row: at least 4 per thread of a program). A slot is one
32-bit store, read by volatile loads: a posted value is its own flag, no fence or atomic needed. Groups never wait
on each other: a group that does not fit beside the others runs in a later wave. Nothing needs a group co-resident
to be correct: a program that polls ``SPIN_LIMIT`` times without seeing a block's slots complete computes the
missing partials itself from memory with the owners' code (the same bits; only the missing bands' rows are read) and
from then on never waits (later blocks: what is posted, the rest computed). The interpreter runs programs one after
another, so there every program but the last of a group takes that path. A group that is not co-resident (more bands
than the GPU holds at once, or SMs taken by other streams' kernels) is therefore correct but slow: the heuristics
ask at most ``BANDS_MAX_PER_SM`` bands per SM of one-warp programs.
"""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from . import backend, kernels, rowmath
from .kernels import F32, _bwd_inputs, _rstd, _span, _weight
from .pallas_config import Config, cdiv, next_pow2
from .rounding import rounder

UNPOSTED = -1  # int32 bits of a slot not yet posted (0xFFFFFFFF)
SPIN_LIMIT = 1 << 14  # polls of a block's slots before a program stops waiting (milliseconds; never hit on a GPU)
INTERPRET_SPIN_LIMIT = 0
WARP = 32  # threads per warp (NVIDIA)
SLOTS_PER_THREAD = 4  # int32 slots per thread of a slot tile: one 16-byte load each


def slot_width(bands: int, block_rows: int, num_warps: int) -> int:
    """Slots per row: the band count padded to a power of two, and to at least ``SLOTS_PER_THREAD`` slots per thread
    over a block's rows (the padding is never posted; reads mask it). A slot tile smaller than the program's threads
    is held in replicas, each loaded by its own thread at its own time: polled slots then differ between the
    replicas, the program's "all posted" test and its sum disagree, and rows came out NaN (H100: 512×65536 in 16 row
    groups). Fewer than 4 per thread (one 16-byte load) made Triton convert the tile's layout through shared memory,
    and a kernel using any shared memory gets XLA's largest carveout (the one-warp kernels' L1: 2.27 against 2.68 TB/s
    at 4096×65536, H100)."""
    return max(next_pow2(bands), next_pow2(cdiv(SLOTS_PER_THREAD * WARP * num_warps, block_rows)))


def slot_cols(config: Config, n: int) -> int:
    """``slot_width`` for a band config."""
    return slot_width(config.chunks(n), config.block_rows, config.num_warps)


def groups(config: Config, n: int) -> int:
    """Row groups of a band config: its ``programs`` (a multiple of the band count) over the band count."""
    return config.programs // config.chunks(n)


def _block_rows(m: int, n: int, config: Config):
    """``rows(t)``: this program's t-th row block (``(rows, mask)``; none for t < 0): row group g walks blocks
    g, g + G, g + 2G, ..."""
    br, g, step = config.block_rows, pl.program_id(1), groups(config, n)

    def rows(t):
        r, rmask = _span((t * step + g) * br, br, m)
        return r, rmask & (t >= 0)

    return rows


def _exchange(slots_ref, partial, rows_of, *, n: int, config: Config, interpret: bool) -> types.SimpleNamespace:
    """One band program's side of the row-sum exchange. ``partial(rows, rmask, cols, cmask)``: each row's partial
    sum over the band ``cols``, read from memory (the owner's code: the fallback's recompute has its bits);
    ``rows_of(u)``: row block u's rows. Returns ``post(rows, rmask, part)``, ``read(u)`` (block u's slots, in flight
    until used) and ``totals(u, posted, alone)`` (``(row sums of block u, alone)``)."""
    bc, parts = config.block_cols, config.chunks(n)
    pid = pl.program_id(0)
    pcols = jnp.arange(slot_cols(config, n), dtype=jnp.int32)
    pmask = pcols < parts
    spin_limit = INTERPRET_SPIN_LIMIT if interpret else SPIN_LIMIT

    def post(rows, rmask, part):
        bits = lax.bitcast_convert_type(jnp.where(part == part, part, F32(jnp.nan)), jnp.int32)
        backend.store(slots_ref.at[rows[:, None], jnp.full((1, 1), pid, jnp.int32)], bits[:, None], rmask[:, None])

    def load(rows, mask):
        return backend.load(slots_ref.at[rows[:, None], pcols[None, :]], mask, other=0, volatile=True)

    def read(u):
        rows, rmask = rows_of(u)
        return load(rows, rmask[:, None] & pmask[None, :])

    def totals(u, posted, alone):
        """From the posted slots once all are in, else (after ``spin_limit`` polls, or once this program has given
        up on an earlier block) with the missing partials recomputed band by band."""
        rows, rmask = rows_of(u)
        mask = rmask[:, None] & pmask[None, :]

        def complete(bits):  # (jnp.all has no Triton lowering: a min over int32, one axis at a time)
            return jnp.min(jnp.min(jnp.where((bits != UNPOSTED) | ~mask, 1, 0), axis=1)) == 1

        _, posted = lax.while_loop(lambda s: ~alone & (s[0] < spin_limit) & ~complete(s[1]),
                                   lambda s: (s[0] + 1, load(rows, mask)), (jnp.int32(0), posted))
        ready = complete(posted)

        def recomputed(_):
            """The posted partials, and the missing ones computed here (only their bands' rows are read)."""
            missing = (posted == UNPOSTED) & mask

            def one(q, acc):
                c, cm = _span(q * bc, bc, n)
                hit = missing & (pcols[None, :] == q)
                rows_q = jnp.max(jnp.where(hit, 1, 0), axis=1) == 1
                part = partial(rows, rows_q, c, cm)
                return jnp.where(hit, part[:, None], acc)

            return lax.fori_loop(0, parts, one, lax.bitcast_convert_type(posted, F32))

        vals = lax.cond(ready, lambda _: lax.bitcast_convert_type(posted, F32), recomputed, None)
        return jnp.sum(jnp.where(mask, vals, F32(0)), axis=1), alone | ~ready

    return types.SimpleNamespace(post=post, read=read, totals=totals)


def _own_band(w_ref, n: int, config: Config, offset: float, casting: str, dt):
    """This program's band: ``(band index, cols, cmask, w_eff over the band)``."""
    pid, bc = pl.program_id(0), config.block_cols
    cols, cmask = _span(pid * bc, bc, n)
    return pid, cols, cmask, _weight(w_ref, cols, cmask, offset, casting, dt)


def _first_read(config: Config) -> str:
    """The cache policy of a band's first read: kept in L2 for the second (``evict_last``), or streamed when the
    tiles are carried to their finish (``evict_first``)."""
    return "evict_first" if config.carry else "evict_last"


def _enqueue(queue: tuple, tiles) -> tuple:
    """The carried blocks after step t: block t's tiles first, block t - lag's (finished at step t) dropped."""
    return (tiles, *queue[:-1])


def _walk_bands(m: int, n: int, config: Config, lag: int, fetch, start, finish, ex, acc_cols: int | None = None):
    """``acc = start(t, fetch(t), acc)`` for every row block t (``acc``: float32 zeros of ``(acc_cols,)`` at first,
    None without ``acc_cols``), and ``finish(t - lag, tiles, posted, alone)`` after it (``lag`` 0: no finishing;
    ``tiles``: block t - lag's, carried in registers since its fetch with ``config.carry``, else None: finish loads
    them again); block t - lag's slots are read before block t's math (in flight meanwhile). With
    ``config.prefetch`` block t + 1 is fetched first. Returns ``acc``."""
    carry = config.carry and lag > 0

    def body(t, state):
        tiles, queue, acc, alone = state
        nxt = fetch(t + 1) if config.prefetch else None
        if not config.prefetch:
            tiles = fetch(t)
        posted = ex.read(t - lag) if lag else None
        acc = start(t, tiles, acc)
        if lag:
            alone = finish(t - lag, queue[-1] if carry else None, posted, alone)
        return nxt, _enqueue(queue, tiles) if carry else (), acc, alone

    first = fetch(0) if config.prefetch else None
    zeros = jax.tree.map(jnp.zeros_like, first if config.prefetch else fetch(0)) if carry else None
    queue = (zeros,) * lag if carry else ()  # blocks -lag .. -1: never finished
    acc = None if acc_cols is None else jnp.zeros((acc_cols,), F32)
    steps = cdiv(cdiv(m, config.block_rows), groups(config, n))
    return lax.fori_loop(0, steps + lag, body, (first, queue, acc, jnp.bool_(False)))[2]


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
    pid, cols, cmask, w_eff = _own_band(w_ref, n, config, offset, casting, dt)

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

    rows_of = _block_rows(m, n, config)
    ex = _exchange(slots_ref, partial_sq, rows_of, n=n, config=config, interpret=interpret)

    def fetch(t):
        return band(*rows_of(t), cols, cmask, _first_read(config))

    def start(t, tiles, acc):
        rows, rmask = rows_of(t)
        h32 = row(tiles)
        ex.post(rows, rmask, jnp.sum(h32 * h32, axis=1))
        return acc

    def finish(u, tiles, posted, alone):
        rows, rmask = rows_of(u)
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

    _walk_bands(m, n, config, max(config.lag, 1), fetch, start, finish, ex)


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
    pid, cols, cmask, w_eff = _own_band(w_ref, n, config, offset, casting, dt)

    def band(rows, rmask, c, cm, policy):
        return (backend.load(x_ref.at[rows[:, None], c[None, :]], rmask[:, None] & cm[None, :], eviction=policy),
                backend.load(dy_ref.at[rows[:, None], c[None, :]], rmask[:, None] & cm[None, :], eviction=policy))

    def sum_gx(x_raw, dy_raw, w):
        """Each row's ``Σ g·x`` over one band (float32, ``(block_rows,)``)."""
        x32, dy32 = x_raw.astype(F32), dy_raw.astype(F32)
        return jnp.sum(rowmath.grad_scale(dy32, w, casting, rounder(dt)) * x32, axis=1)

    def partial_gx(rows, rmask, c, cm):
        return sum_gx(*band(rows, rmask, c, cm, None), _weight(w_ref, c, cm, offset, casting, dt))

    rows_of = _block_rows(m, n, config)
    ex = _exchange(slots_ref, partial_gx, rows_of, n=n, config=config, interpret=interpret) if need_dx else None

    def fetch(t):
        """Block ``t``'s band of x and dy, and its rstd, from memory (kept in L2 for a second read)."""
        rows, rmask = rows_of(t)
        return (*band(rows, rmask, cols, cmask, _first_read(config)), backend.load(rstd_ref.at[rows], rmask))

    def start(t, tiles, dw):
        """Block ``t``: its ``dweight`` terms, and its rows' partial sums posted."""
        x_raw, dy_raw, rstd = tiles
        rows, rmask = rows_of(t)
        if need_dw:
            n_val = rowmath.normalized(x_raw.astype(F32), rstd[:, None], casting, rounder(dt))
            dw = dw + jnp.sum(rowmath.dweight_terms(dy_raw.astype(F32), n_val), axis=0)
        if need_dx:
            ex.post(rows, rmask, sum_gx(x_raw, dy_raw, w_eff))
        return dw

    def finish(u, tiles, posted, alone):
        """Block ``u``: its ``dx`` from the band (carried, or read again: L1 or L2) and the rows' totals."""
        rows, rmask = rows_of(u)
        if tiles is None:
            x_raw, dy_raw = band(rows, rmask, cols, cmask, "evict_first")
            rstd = backend.load(rstd_ref.at[rows], rmask)
        else:
            x_raw, dy_raw, rstd = tiles
        rstd = rstd[:, None]
        total, alone = ex.totals(u, posted, alone)
        x32, dy32 = x_raw.astype(F32), dy_raw.astype(F32)
        dx = rowmath.grad_input(x32, rowmath.grad_scale(dy32, w_eff, casting, rounder(dt)), rstd, total[:, None],
                                F32(n))
        tile_mask = rmask[:, None] & cmask[None, :]
        if dh_ref is not None:
            dx = rowmath.grad_residual(dx, backend.load(dh_ref.at[rows[:, None], cols[None, :]], tile_mask).astype(F32))
        backend.store(dx_ref.at[rows[:, None], cols[None, :]], dx.astype(dt), tile_mask)
        return alone

    dw = _walk_bands(m, n, config, config.lag if need_dx else 0, fetch, start, finish, ex, bc)
    if need_dw and len(dw_ref.shape) == 1:  # one row group: this band's dweight itself
        backend.store(dw_ref.at[cols], dw.astype(dw_ref.dtype), cmask)
    elif need_dw:  # the group's partial, summed in group order by kernels' reduction
        backend.store(dw_ref.at[pl.program_id(1), cols], dw, cmask)


def _slots(m: int, n: int, config: Config):
    return jnp.full((m, slot_cols(config, n)), UNPOSTED, jnp.int32)


def forward(x, weight, *, eps: float, offset: float, casting: str, config: Config, interpret: bool,
            residual=None, h_dtype=None):
    """As ``kernels.forward``, for a band config (``config.lag``; a forward finishes at least one block late):
    one launch, rstd stored by band 0's program."""
    m, n = x.shape
    fused = residual is not None
    kernel = functools.partial(_fwd_kernel, m=m, n=n, eps=eps, offset=offset, casting=casting, config=config,
                               has_weight=weight is not None, has_residual=fused, interpret=interpret)
    args = (x, *((residual,) if fused else ()), *(() if weight is None else (weight,)), _slots(m, n, config))
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
        args.append(_slots(m, n, config))
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
        dweight = kernels.reduce_dweight(dweight, weight.dtype, interpret=interpret)
    return dx, dweight
