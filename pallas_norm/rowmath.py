"""RMSNorm's row math, written once (see ``docs/semantics.md``).

Every function takes and returns float32 ``jax.numpy`` values (``dt`` is the input dtype that the casting mode
rounds to) and works on whole blocks, so the Pallas kernel bodies and the XLA reference call the same code.
``w_eff=None`` means no weight.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from .rounding import round_to

F32 = jnp.float32


def rstd_from_sumsq(sumsq: jnp.ndarray, n: int, eps: float) -> jnp.ndarray:
    """``rstd = rsqrt(sum(x32²) / N + eps)``, float32."""
    return lax.rsqrt(sumsq / F32(n) + F32(eps))


def effective_weight(w: jnp.ndarray, offset: float, casting: str, dt: jnp.dtype) -> jnp.ndarray:
    """``w_eff = f32(w) + offset``; for ``"none"`` ``f32(r(f32(r(w)) + offset))`` (weight math in ``dt``)."""
    w32 = w.astype(F32)
    if casting == "none":
        return round_to(round_to(w32, dt) + F32(offset), dt)
    return w32 + F32(offset)


def normalized(x32: jnp.ndarray, rstd: jnp.ndarray, casting: str, dt: jnp.dtype) -> jnp.ndarray:
    """The normalised value ``n``: llama ``r(x32·rstd)``; gemma ``x32·rstd``; none ``r(x32·r(rstd))``."""
    if casting == "llama":
        return round_to(x32 * rstd, dt)
    if casting == "gemma":
        return x32 * rstd
    return round_to(x32 * round_to(rstd, dt), dt)


def output(n: jnp.ndarray, w_eff: jnp.ndarray | None, dt: jnp.dtype) -> jnp.ndarray:
    """``y = r(n · w_eff)`` (``r(n)`` without a weight), in ``dt``."""
    return (n if w_eff is None else n * w_eff).astype(dt)


def grad_scale(dy32: jnp.ndarray, w_eff: jnp.ndarray | None, casting: str, dt: jnp.dtype) -> jnp.ndarray:
    """``g = dy·w_eff``: float32 for gemma, rounded to ``dt`` for llama and none (as HF autograd does)."""
    g = dy32 if w_eff is None else dy32 * w_eff
    return g if casting == "gemma" else round_to(g, dt)


def grad_input(x32: jnp.ndarray, g: jnp.ndarray, rstd: jnp.ndarray, sum_gx: jnp.ndarray, n: int) -> jnp.ndarray:
    """``dx = rstd·(g − x32·rstd²·mean(g·x32))`` in float32 (the caller rounds to ``dt``)."""
    return rstd * (g - x32 * (rstd * rstd * (sum_gx / F32(n))))


def dweight_terms(dy32: jnp.ndarray, n_value: jnp.ndarray) -> jnp.ndarray:
    """Per-element contribution to ``dweight = Σ_rows dy·n`` (float32)."""
    return dy32 * n_value
