"""The ``impl="xla"`` implementation: RMSNorm in plain ``jax.numpy`` with float32 math, compiled by XLA.

Built from the same ``rowmath`` functions as the kernels, so the two differ only in reduction order.
``rms_norm_reference`` is the same forward as a public, differentiable-by-autodiff function.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from . import rowmath
from .checks import check_inputs
from .rounding import rounder

F32 = jnp.float32


def forward_2d(x, weight, *, eps: float, offset: float, casting: str, residual=None, h_dtype=None):
    """``(y, rstd)`` for 2-D ``x``: ``rstd = rsqrt(mean(x32²) + eps)``, ``y`` per ``docs/semantics.md``. With
    ``residual`` (the fused add): ``(y, h, rstd)`` with ``h = r(x + residual)`` in ``h_dtype``, normalised."""
    if residual is not None:
        h = rowmath.residual_add(x.astype(F32), residual.astype(F32), rounder(h_dtype)).astype(h_dtype)
        y, rstd = forward_2d(h, weight, eps=eps, offset=offset, casting=casting)
        return y, h, rstd
    dt, r = x.dtype, rounder(x.dtype)
    x32 = x.astype(F32)
    rstd = rowmath.rstd_from_sumsq(jnp.sum(x32 * x32, axis=-1), F32(x.shape[-1]), F32(eps), lax.rsqrt)
    n_val = rowmath.normalized(x32, rstd[:, None], casting, r)
    w_eff = None if weight is None else rowmath.effective_weight(weight.astype(F32), F32(offset), casting, r)
    return rowmath.output(n_val, w_eff).astype(dt), rstd


def backward_2d(x, weight, dy, rstd, *, offset: float, casting: str, dh_out=None):
    """``(dx, dweight)``: ``dx = rstd·(g − x·rstd²·mean(g·x))``, ``g = dy·w_eff``; ``dweight = Σ_rows dy·n``.
    With ``dh_out`` (the fused add's backward, ``x`` being ``h``): ``dx = r(dx_norm + dh_out)``."""
    dt, r = x.dtype, rounder(x.dtype)
    n = x.shape[-1]
    x32, dy32, rstd = x.astype(F32), dy.astype(F32), rstd[:, None]
    w_eff = None if weight is None else rowmath.effective_weight(weight.astype(F32), F32(offset), casting, r)[None, :]
    g = rowmath.grad_scale(dy32, w_eff, casting, r)
    dx = rowmath.grad_input(x32, g, rstd, jnp.sum(g * x32, axis=-1, keepdims=True), F32(n))
    if dh_out is not None:
        dx = rowmath.grad_residual(dx, dh_out.astype(F32))
    dx = dx.astype(dt)
    if weight is None:
        return dx, None
    n_val = rowmath.normalized(x32, rstd, casting, r)
    dweight = jnp.sum(rowmath.dweight_terms(dy32, n_val), axis=0).astype(weight.dtype)
    return dx, dweight


def rms_norm_reference(
    x: jax.Array,
    weight: jax.Array | None = None,
    *,
    eps: float = 1e-6,
    offset: float = 0.0,
    casting: str = "llama",
) -> jax.Array:
    """``y = x·rsqrt(mean(x²) + eps)·(weight + offset)`` with ``casting``'s roundings, as plain ``jax.numpy``.

    Differentiable by ordinary autodiff (its gradient matches ``docs/semantics.md`` for "llama" and "gemma";
    for "none" autodiff also rounds the cotangent of the rounded ``rstd``).
    """
    x, weight, eps, offset, casting = check_inputs(x, weight, eps, offset, casting)
    y, _ = forward_2d(x.reshape(-1, x.shape[-1]), weight, eps=eps, offset=offset, casting=casting)
    return y.reshape(x.shape)
