"""``rms_norm_add``: the residual add and RMSNorm of a pre-norm decoder fused into one kernel per direction.

``h = x + residual`` (rounded once, to ``residual_dtype``) and ``y = rms_norm(h)``: the forward reads ``x`` and
``residual`` and writes ``y`` and ``h`` (no separate add reading and writing the hidden state); the backward reads
``h``, ``dy`` and ``h``'s own cotangent ``dh_out`` and writes ``dh = d_norm(dy) + dh_out``, which is both ``dx`` and
``dresidual``. The same kernels, row math, custom VJP machinery and sharding rules as ``rms_norm``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import sharding
from .api import _local_only, _opt, backward_fn, check_configs, forward_fn, resolve_impl
from .checks import DTYPES, check_array, check_inputs
from .pallas_config import Config


def _check_residual(x: jax.Array, residual: object, residual_dtype: object) -> tuple[jax.Array, jnp.dtype]:
    check_array("residual", residual)
    if tuple(residual.shape) != tuple(x.shape):
        raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    if residual_dtype is None:
        return jnp.asarray(residual), jnp.dtype(x.dtype)
    try:
        h_dtype = jnp.dtype(residual_dtype)
    except TypeError as err:
        raise TypeError(f"residual_dtype must be None or a dtype in (float32, bfloat16, float16), got "
                        f"{residual_dtype!r}") from err
    if h_dtype not in DTYPES:
        raise TypeError(f"residual_dtype must be None or a dtype in (float32, bfloat16, float16), got {h_dtype}")
    return jnp.asarray(residual), h_dtype


def rms_norm_add(
    x: jax.Array,
    residual: jax.Array,
    weight: jax.Array | None = None,
    *,
    eps: float = 1e-6,
    offset: float = 0.0,
    casting: str = "llama",
    residual_dtype=None,
    impl: str | None = None,
    config: Config | None = None,
    bwd_config: Config | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``(y, h)``: ``h = r(x + residual)`` in ``residual_dtype`` (default ``x.dtype``; float32 for an fp32 residual
    stream), added in float32 and rounded once; ``y = rms_norm(h, weight, eps=eps, offset=offset,
    casting=casting)``, bit for bit (but rows of 16384 columns without the triton package: docs/jax.md), in ``h``'s
    dtype.

    Backward (custom VJP): with ``dy`` the cotangent of ``y`` and ``dh_out`` that of ``h``,
    ``dh = r(dx_norm + dh_out)`` (one rounding of the float32 sum, where unfused autodiff rounds twice);
    ``dx = dh`` in ``x.dtype``, ``dresidual = dh`` in ``residual.dtype``; ``dweight`` as ``rms_norm``'s for ``h``
    (float32-accumulated, deterministic). Cotangents are never written. ``impl``, ``config`` and ``bwd_config``
    as for ``rms_norm``; works under ``jit``, ``grad``, ``vmap``, ``jax.checkpoint`` and ``rms_norm``'s sharding
    rules (rows sharded, the hidden axis whole).
    """
    x, weight, eps, offset, casting = check_inputs(x, weight, eps, offset, casting)
    residual, h_dtype = _check_residual(x, residual, residual_dtype)
    impl = resolve_impl(impl)
    check_configs(impl, config=config, bwd_config=bwd_config)
    return _rms_norm_add(x, residual, weight, eps, offset, casting, h_dtype, impl, config, bwd_config)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7, 8, 9))
def _rms_norm_add(x, residual, weight, eps, offset, casting, h_dtype, impl, config, bwd_config):
    return _fwd(x, residual, weight, eps, offset, casting, h_dtype, impl, config, bwd_config)[0]


def _fwd(x, residual, weight, eps, offset, casting, h_dtype, impl, config, bwd_config):
    fwd = sharding.forward(forward_fn(eps, offset, casting, impl, config, h_dtype), weight is not None, fused=True,
                           local_only=_local_only(impl))
    y, h, rstd = fwd(x, residual, *_opt(weight))
    # zero-size arrays carry x's and residual's dtypes to the backward (their cotangents' dtypes)
    return (y, h), (h, weight, rstd, jnp.zeros((0,), x.dtype), jnp.zeros((0,), residual.dtype))


def _bwd(eps, offset, casting, h_dtype, impl, config, bwd_config, residuals, cotangents):
    h, weight, rstd, x_tag, r_tag = residuals
    dy, dh_out = cotangents
    has_weight = weight is not None
    bwd = sharding.backward(backward_fn(offset, casting, impl, has_weight, bwd_config, fused=True), has_weight,
                            fused=True, local_only=_local_only(impl))
    dh, dweight = bwd(h, *_opt(weight), dy, dh_out, rstd)
    return dh.astype(x_tag.dtype), dh.astype(r_tag.dtype), dweight


_rms_norm_add.defvjp(_fwd, _bwd)
