"""Tiles of the Triton lowering's kernels (``kernels``, ``bands``, ``dweight``): index spans with their masks, masked
tile loads, a tile's effective weight and the row's ``rstd``; memory access through ``backend``, row math from
``rowmath``."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from . import backend, rowmath
from .rounding import rounder

F32 = jnp.float32


def _span(start, size: int, limit: int):
    idx = start + jnp.arange(size, dtype=jnp.int32)
    return idx, idx < limit


def _col_mask(cols, cmask):
    """``cmask``, or where it is None (every column is in the row) all true."""
    return jnp.full(cols.shape, True) if cmask is None else cmask


def _tile_mask(rmask, cols, cmask):
    """The mask of an ``(rows, cols)`` tile; ``cmask`` None: every column is in the row (no column test)."""
    if cmask is None:
        return jnp.broadcast_to(rmask[:, None], (rmask.shape[0], cols.shape[0]))
    return rmask[:, None] & cmask[None, :]


def _tile(ref, rows, rmask, cols, cmask, dtype=F32, eviction: str | None = None):
    """Load an ``(rows, cols)`` tile, widened to ``dtype`` (None: as stored); masked-off lanes read 0; ``eviction``:
    ``backend.load``'s cache hint."""
    tile = backend.load(ref.at[rows[:, None], cols[None, :]], _tile_mask(rmask, cols, cmask), eviction=eviction)
    return tile if dtype is None else tile.astype(dtype)


def _weight(w_ref, cols, cmask, offset: float, casting: str, dt, eviction: str | None = None):
    """``w_eff`` over ``cols`` in float32, a row vector (``eviction``: ``backend.load``'s cache hint)."""
    if w_ref is None:
        return None
    w32 = backend.load(w_ref.at[cols], _col_mask(cols, cmask), eviction=eviction).astype(F32)
    return rowmath.effective_weight(w32, F32(offset), casting, rounder(dt))[None, :]


def _rstd(sumsq, n: int, eps: float):
    return rowmath.rstd_from_sumsq(sumsq, F32(n), F32(eps), lax.rsqrt)
