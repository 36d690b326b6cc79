"""Flax NNX module around ``pallas_norm.rms_norm`` (needs the ``flax`` extra)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from .api import resolve_impl, rms_norm
from .checks import DTYPES
from .semantics import check_scalars


class RMSNorm(nnx.Module):
    """``y = x · rsqrt(mean(x²) + eps) · (scale + offset)`` over the last axis, by the Pallas kernel on GPU.

    Modelled on ``flax.nnx.RMSNorm`` (the parameter is named ``scale`` as there, so states interchange).
    ``scale`` starts at ones, or at zeros when ``offset == 1`` (the Gemma convention ``(1 + w)``).
    ``casting`` is ``"llama"``, ``"gemma"`` or ``"none"`` (see ``pallas_norm.rms_norm``); ``impl`` as there.
    """

    def __init__(
        self,
        num_features: int,
        *,
        eps: float = 1e-6,
        offset: float = 0.0,
        casting: str = "llama",
        param_dtype: jnp.dtype = jnp.float32,
        use_scale: bool = True,
        impl: str | None = None,
        rngs: nnx.Rngs | None = None,
    ):
        if isinstance(num_features, bool) or not isinstance(num_features, int) or num_features < 1:
            raise ValueError(f"num_features must be a positive int, got {num_features!r}")
        self.eps, self.offset, self.casting = check_scalars(eps, offset, casting, has_weight=use_scale)
        if jnp.dtype(param_dtype) not in DTYPES:
            raise TypeError(f"param_dtype must be float32, bfloat16 or float16, got {jnp.dtype(param_dtype)}")
        if impl is not None:
            resolve_impl(impl)
        self.impl = impl
        self.num_features = num_features
        init = jnp.zeros if self.offset == 1.0 else jnp.ones
        self.scale = nnx.Param(init((num_features,), param_dtype)) if use_scale else None

    def __call__(self, x: jax.Array) -> jax.Array:
        if getattr(x, "shape", (None,))[-1:] != (self.num_features,):
            raise ValueError(f"x's last axis must be num_features={self.num_features}, got shape "
                             f"{tuple(getattr(x, 'shape', ()))}")
        scale = None if self.scale is None else self.scale[...]
        return rms_norm(x, scale, eps=self.eps, offset=self.offset, casting=self.casting, impl=self.impl)
