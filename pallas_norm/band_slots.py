"""The row-sum exchange of column bands (``bands.py``): the slots every band program posts its rows' partial sums
to and polls for its peers'.

``slots[row, band]`` holds band ``band``'s partial sum of ``row`` as int32 bits. The buffer arrives filled with
``UNPOSTED`` (an int32 NaN payload no float32 arithmetic produces; a NaN partial is posted as the canonical NaN) and
is aliased to a kernel output, so XLA (or the torch launch route) hands the kernel a fresh filled buffer per call
(``slot_width`` slots per row: at least 4 per thread of a program). A slot is one 32-bit store, read by volatile
loads: a posted value is its own flag, no fence or atomic needed. A program that polls ``SPIN_LIMIT`` times without
seeing a block's slots complete computes the missing partials itself from memory with the owners' code (the same
bits; only the missing bands' rows are read) and from then on never waits. The Triton reference
(``torch_bridge/triton_bands.py``) sizes its slots with ``slot_width`` too.
"""

from __future__ import annotations

import types

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from . import backend
from .tiles import F32, _span
from .pallas_config import Config, cdiv, next_pow2

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


def block_rows_of(m: int, n: int, config: Config):
    """``rows(t)``: this program's t-th row block (``(rows, mask)``; none for t < 0): row group g walks blocks
    g, g + G, g + 2G, ..."""
    br, g, step = config.block_rows, pl.program_id(1), groups(config, n)

    def rows(t):
        r, rmask = _span((t * step + g) * br, br, m)
        return r, rmask & (t >= 0)

    return rows


def exchange(slots_ref, partial, rows_of, *, n: int, config: Config, interpret: bool) -> types.SimpleNamespace:
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


def slots(m: int, n: int, config: Config):
    """A fresh ``(m, slot_cols)`` buffer of ``UNPOSTED`` slots (aliased to the band kernel's slots output)."""
    return jnp.full((m, slot_cols(config, n)), UNPOSTED, jnp.int32)
