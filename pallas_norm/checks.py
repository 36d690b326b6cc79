"""Input checks for the JAX entry points: clear ``TypeError``/``ValueError`` before any work is traced."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .semantics import check_scalars

DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _check_array(name: str, value: object) -> jax.Array:
    if not isinstance(value, (jax.Array, np.ndarray)):
        raise TypeError(f"{name} must be a jax.Array (or numpy array), got {type(value).__module__}."
                        f"{type(value).__name__}")
    if jnp.dtype(value.dtype) not in DTYPES:
        raise TypeError(f"{name} must have a floating dtype in (float32, bfloat16, float16), got {value.dtype}")
    return jnp.asarray(value)


def check_inputs(x: object, weight: object, eps: object, offset: object, casting: object):
    """Validate everything ``rms_norm`` takes; return ``(x, weight, eps, offset, casting)`` normalised."""
    x = _check_array("x", x)
    if x.ndim < 1:
        raise ValueError(f"x must have at least 1 dimension (rows × hidden), got a {x.ndim}-d array")
    if x.shape[-1] < 1:
        raise ValueError(f"x's last axis (the hidden size N) must be >= 1, got shape {tuple(x.shape)}")
    if weight is not None:
        weight = _check_array("weight", weight)
        if weight.shape != (x.shape[-1],):
            raise ValueError(f"weight must have shape ({x.shape[-1]},) (x's last axis), got {tuple(weight.shape)}")
    eps, offset, casting = check_scalars(eps, offset, casting, has_weight=weight is not None)
    return x, weight, eps, offset, casting
