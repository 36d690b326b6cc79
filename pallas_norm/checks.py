"""Input checks for the JAX entry points: clear ``TypeError``/``ValueError`` before any work is traced or any
array is transferred (everything is validated on the caller's objects first, converted last)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .semantics import check_scalars

DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def check_array(name: str, value: object) -> None:
    if not isinstance(value, (jax.Array, np.ndarray)):
        kind = f"{type(value).__module__}.{type(value).__name__}"
        hint = "; for torch tensors use torch_bridge.rms_norm" if kind.startswith("torch.") else ""
        raise TypeError(f"{name} must be a jax.Array (or numpy array), got {kind}{hint}")
    if jnp.dtype(value.dtype) not in DTYPES:
        raise TypeError(f"{name} must have a floating dtype in (float32, bfloat16, float16), got {value.dtype}")


def _devices(value: object) -> set | None:
    """The devices of a committed concrete ``jax.Array`` (None for numpy arrays, tracers, uncommitted arrays)."""
    if isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer) and value.committed:
        return set(value.devices())
    return None


def check_inputs(x: object, weight: object, eps: object, offset: object, casting: object):
    """Validate everything ``rms_norm`` takes; return ``(x, weight, eps, offset, casting)`` normalised."""
    check_array("x", x)
    if x.ndim < 1:
        raise ValueError(f"x must have at least 1 dimension (rows × hidden), got a {x.ndim}-d array")
    if x.shape[-1] < 1:
        raise ValueError(f"x's last axis (the hidden size N) must be >= 1, got shape {tuple(x.shape)}")
    if weight is not None:
        check_array("weight", weight)
        if tuple(weight.shape) != (x.shape[-1],):
            raise ValueError(f"weight must have shape ({x.shape[-1]},) (x's last axis), got {tuple(weight.shape)}")
        x_devices, w_devices = _devices(x), _devices(weight)
        if x_devices is not None and w_devices is not None and x_devices != w_devices:
            raise ValueError(f"weight must be on x's devices {sorted(map(str, x_devices))}, got "
                             f"{sorted(map(str, w_devices))}")
    eps, offset, casting = check_scalars(eps, offset, casting, has_weight=weight is not None)
    return jnp.asarray(x), None if weight is None else jnp.asarray(weight), eps, offset, casting


def last_axis_only(axes: object, ndim: int) -> bool:
    """Whether ``axes`` (an int or a sequence, as Flax's ``reduction_axes``/``feature_axes``) is the last axis only."""
    axes = (axes,) if isinstance(axes, int) else tuple(axes) if isinstance(axes, (tuple, list)) else None
    return axes is not None and len(axes) == 1 and isinstance(axes[0], int) and axes[0] % max(ndim, 1) == ndim - 1


def check_flax_options(module: str, *, reduction_axes, feature_axes, axis_name, ndim: int) -> None:
    """Refuse the options of Flax's RMSNorm that pallas-norm does not implement, naming the Flax module to use."""
    for name, axes in (("reduction_axes", reduction_axes), ("feature_axes", feature_axes)):
        if not last_axis_only(axes, ndim):
            raise ValueError(f"{name} must be the last axis (-1) for {module}, got {axes!r}; use Flax's own RMSNorm "
                             "to normalise over other axes")
    if axis_name is not None:
        raise ValueError(f"axis_name must be None for {module} (rows are normalised independently; shard the rows, "
                         f"not the hidden axis), got {axis_name!r}")
