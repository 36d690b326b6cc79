"""Tiles of the Triton lowering's kernels (``kernels``, ``bands``, ``dweight``): index spans with their masks, masked
tile loads, a tile's effective weight (float32, or values of the row dtype where products are taken in it) and the
row's ``rstd``; memory access through ``backend``, row math from ``rowmath``."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from . import backend, rowmath
from .rounding import rounder

F32 = jnp.float32


def product_in_dtype(weight_dtype, dt, casting: str, offset: float) -> bool:
    """Whether the forward multiplies y's ``n · w_eff`` in the row dtype ``dt`` (``rowmath.output_in_dtype``; without
    a weight, no)."""
    return weight_dtype is not None and rowmath.output_in_dtype(
        casting, offset, jnp.dtype(weight_dtype) == jnp.dtype(dt), jnp.dtype(dt).itemsize < 4)


# rms_norm's backward multiplies g = r(dy·w_eff) in the row dtype where both factors are its values
# (``product_in_dtype``): one bf16x2/f16x2 multiply per pair, the float32 product's bits. Thirty-fourth session (H100,
# impl=None from JAX, kernels timed, off/on alternating over four processes; probes_h100_2026-11-27_thirtyfourth.md
# §2), TB/s off → on: bf16 4096×1024 2.04-2.05 → 2.11, 4096×2048 2.40 → 2.46, 4096×4096 2.66 → 2.68, 4096×8192
# 2.80 → 2.81, 32768×1024 2.84 → 2.85, 32768×4096 2.96-2.97 → 2.95-2.96; fp16 alike (4096×1024 2.06 → 2.13). The
# fused add's backward keeps the float32 product: +0.3-0.7% at 1024-2048 columns, -1% at bf16 4096×8192. The band
# backward takes it for both (fifty-second session, H200: +5-8% bf16, ``bands._bwd_kernel``).
BWD_LOW_DTYPES = ("bfloat16", "float16")


def grad_in_dtype(weight_dtype, dt, casting: str, offset: float, fused: bool = False) -> bool:
    """Whether the backward (of the fused add: ``fused``) multiplies g = r(dy·w_eff) in the row dtype ``dt``
    (``BWD_LOW_DTYPES``, ``rms_norm``'s only; ``product_in_dtype``: the same bits)."""
    return not fused and jnp.dtype(dt).name in BWD_LOW_DTYPES and product_in_dtype(weight_dtype, dt, casting, offset)


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


def _weight_in_dtype(w_ref, cols, cmask, offset: float, casting: str, dt, eviction: str | None = None):
    """``w_eff`` over ``cols`` as values of the row dtype ``dt``, a row vector, where ``rowmath.output_in_dtype``
    holds: llama's weight as stored (no offset), none's ``r(r(w) + offset)``."""
    if casting == "llama":
        return backend.load(w_ref.at[cols], _col_mask(cols, cmask), eviction=eviction)[None, :]
    return _weight(w_ref, cols, cmask, offset, casting, dt, eviction).astype(dt)


def _weight_of(w_ref, cols, cmask, offset: float, casting: str, dt, low: bool, eviction: str | None = None):
    """``w_eff`` over ``cols``: float32 (``_weight``), or with ``low`` values of the row dtype ``dt``
    (``_weight_in_dtype``, where ``product_in_dtype``/``grad_in_dtype`` hold)."""
    return (_weight_in_dtype if low else _weight)(w_ref, cols, cmask, offset, casting, dt, eviction)


def _grad(dy, w_eff, casting: str, dt, low: bool, dy32=None, ops=None):
    """``g = dy·w_eff`` (``rowmath.grad_scale``) in float32 from the tile ``dy`` as loaded: with ``low``
    (``grad_in_dtype``; ``w_eff`` from ``_weight_of``) one multiply in ``dt`` (one bf16x2/f16x2 instruction per pair,
    the float32 product's bits), widened (``round_to`` of it: kept under XLA too); else from ``dy``'s float32 values
    (``dy32`` where the caller has them). ``ops``: how it widens and rounds (``backend.RowOps``; None: ``plain_ops``;
    ``pairs`` only widen the product in ``dt``, which a compiled kernel has rounded)."""
    ops = ops or backend.plain_ops(dt)
    if low:
        keep = ops.widen if ops.fused else (lambda v: ops.round(ops.widen(v)))
        return keep(rowmath.grad_scale(dy, w_eff, casting, lambda v: v))
    return rowmath.grad_scale(ops.widen(dy) if dy32 is None else dy32, w_eff, casting, ops.round)


def _rstd(sumsq, n: int, eps: float):
    return rowmath.rstd_from_sumsq(sumsq, F32(n), F32(eps), lax.rsqrt)
