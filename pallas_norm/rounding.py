"""``round_to``: round float32 values to a narrower float dtype and widen them back, as one primitive.

``v.astype(dt).astype(f32)`` is not enough: XLA, allowed excess precision by default, deletes such convert
pairs, and with them the roundings that the casting modes promise. ``round_to_p`` lowers differently per
backend: in XLA as ``reduce_precision`` (kept by XLA) plus an exact branch for fp16 subnormals, which
``reduce_precision`` flushes; in Pallas's Triton kernels as a plain convert round trip (``backend.py``).
Under autodiff it behaves like ``astype`` (the tangent is rounded the same way, linearly).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

F32 = jnp.float32
round_to_p = Primitive("pallas_norm_round_to")


def round_to(v: jnp.ndarray, dt) -> jnp.ndarray:
    """``f32(r(v))`` for float32 ``v``: nearest-even rounding to ``dt`` (subnormals and overflow included)."""
    dt = jnp.dtype(dt)
    if dt == jnp.dtype(F32):
        return v
    return round_to_p.bind(v, dtype=dt)


def rounder(dt):
    """``r`` for ``rowmath``: ``v -> round_to(v, dt)`` (the identity for float32)."""
    dt = jnp.dtype(dt)
    return lambda v: round_to(v, dt)


def _xla_rule(v, *, dtype):
    info = jnp.finfo(dtype)
    rounded = lax.reduce_precision(v, exponent_bits=info.nexp, mantissa_bits=info.nmant)
    if dtype != jnp.dtype(jnp.float16):
        return rounded
    # fp16 subnormals are the multiples of 2^-24 below 2^-14: scale by 2^24 (exact) and round to an integer,
    # nearest-even, with exact float32 steps (floor and the fraction below 1024 are exact).
    a = jnp.abs(v) * F32(2.0**24)
    k = jnp.floor(a)
    frac = a - k
    up = (frac > F32(0.5)) | ((frac == F32(0.5)) & (jnp.fmod(k, F32(2.0)) == F32(1.0)))
    sub = (k + up.astype(F32)) * F32(2.0**-24)
    sub = jnp.where(v < 0, -sub, sub)
    return jnp.where(jnp.abs(v) < F32(info.smallest_normal), sub, rounded)


round_to_p.def_abstract_eval(lambda v, *, dtype: v)
round_to_p.def_impl(lambda v, *, dtype: _xla_rule(v, dtype=dtype))
mlir.register_lowering(round_to_p, mlir.lower_fun(_xla_rule, multiple_results=False))
batching.defvectorized(round_to_p)
ad.defjvp(round_to_p, lambda t, v, *, dtype: t.astype(dtype).astype(t.dtype))
