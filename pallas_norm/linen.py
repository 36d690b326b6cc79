"""Flax Linen module: ``flax.linen.RMSNorm``'s signature and parameter name, computed by ``pallas_norm.rms_norm``.

Drop-in for models built with ``flax.linen``: the same attributes, the same ``scale`` parameter (variables of one
load into the other), the same output dtype (``dtype``, else promoted from ``x`` and ``scale``), and by default
the same formula: ``x·rsqrt(mean(x²) + epsilon)·scale`` in float32 with one rounding at the end (``casting="gemma"``,
``offset=0``). ``offset``/``casting`` select the other modes (Gemma's ``(1 + scale)``, Llama's rounding points).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from .api import resolve_impl, rms_norm
from .checks import check_flax_options
from .semantics import check_scalars


class RMSNorm(nn.Module):
    """``y = x · rsqrt(mean(x²) + epsilon) · (scale + offset)`` over the last axis, by the Pallas kernel on GPU.

    Attributes as ``flax.linen.RMSNorm`` (``reduction_axes``/``feature_axes`` must be the last axis, ``axis_name``
    None, ``force_float32_reductions`` True: statistics are always float32; ``use_fast_variance`` has no effect:
    there is no mean), plus ``offset``, ``casting`` and ``impl`` of ``pallas_norm.rms_norm``.
    """

    epsilon: float = 1e-6
    dtype: Any = None
    param_dtype: Any = jnp.float32
    use_scale: bool = True
    scale_init: Any = nn.initializers.ones
    reduction_axes: Any = -1
    feature_axes: Any = -1
    axis_name: str | None = None
    axis_index_groups: Any = None
    use_fast_variance: bool = True
    force_float32_reductions: bool = True
    offset: float = 0.0
    casting: str = "gemma"
    impl: str | None = None

    @nn.compact
    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
        check_flax_options("pallas_norm.linen.RMSNorm", reduction_axes=self.reduction_axes,
                           feature_axes=self.feature_axes, axis_name=self.axis_name, ndim=jnp.ndim(x))
        if mask is not None or not self.force_float32_reductions:
            raise ValueError("pallas_norm.linen.RMSNorm takes no mask and always reduces in float32 "
                             "(force_float32_reductions=True); use flax.linen.RMSNorm for those options")
        eps, offset, casting = check_scalars(self.epsilon, self.offset, self.casting, has_weight=self.use_scale)
        impl = None if self.impl is None else resolve_impl(self.impl)
        scale = self.param("scale", self.scale_init, (jnp.shape(x)[-1],), self.param_dtype) if self.use_scale else None
        out = jnp.dtype(self.dtype or (x.dtype if scale is None else jnp.result_type(x, scale)))
        if out.itemsize > jnp.dtype(x.dtype).itemsize:  # Flax computes in the wider dtype, unrounded
            x = x.astype(out)
        return rms_norm(x, scale, eps=eps, offset=offset, casting=casting, impl=impl).astype(out)
