"""Flax NNX: ``RMSNorm`` around ``pallas_norm.rms_norm``, and ``patch_model`` to swap it into an existing model."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import accuracy
from .api import resolve_impl, rms_norm
from .fused_add import rms_norm_add
from .checks import DTYPES
from .semantics import check_scalars


class RMSNorm(nnx.Module):
    """``y = x · rsqrt(mean(x²) + eps) · (scale + offset)`` over the last axis, by the Pallas kernel on GPU.

    Modelled on ``flax.nnx.RMSNorm`` (the parameter is named ``scale`` as there, so states interchange).
    ``scale`` starts at ones, or at zeros when ``offset == 1`` (the Gemma convention ``(1 + w)``).
    ``casting`` is ``"llama"``, ``"gemma"`` or ``"none"`` (see ``pallas_norm.rms_norm``); ``impl`` as there.
    ``y`` has ``x``'s dtype; with ``promote_dtype`` (Flax's function, as ``patch_model`` sets it) ``x`` and
    ``scale`` are first promoted as ``flax.nnx.RMSNorm`` promotes them (to ``dtype``, else to their common dtype).
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
        dtype: jnp.dtype | None = None,
        promote_dtype: Callable | None = None,
        rngs: nnx.Rngs | None = None,
    ):
        if isinstance(num_features, bool) or not isinstance(num_features, int) or num_features < 1:
            raise ValueError(f"num_features must be a positive int, got {num_features!r}")
        self.eps, self.offset, self.casting = check_scalars(eps, offset, casting, has_weight=use_scale)
        for name, dt in (("param_dtype", param_dtype), ("dtype", dtype)):
            if dt is not None and jnp.dtype(dt) not in DTYPES:
                raise TypeError(f"{name} must be float32, bfloat16 or float16, got {jnp.dtype(dt)}")
        if impl is not None:
            resolve_impl(impl)
        self.impl, self.dtype, self.promote_dtype = impl, dtype, promote_dtype
        self.num_features = num_features
        init = jnp.zeros if self.offset == 1.0 else jnp.ones
        self.scale = nnx.Param(init((num_features,), param_dtype)) if use_scale else None

    def __call__(self, x: jax.Array) -> jax.Array:
        if getattr(x, "shape", (None,))[-1:] != (self.num_features,):
            raise ValueError(f"x's last axis must be num_features={self.num_features}, got shape "
                             f"{tuple(getattr(x, 'shape', ()))}")
        scale = None if self.scale is None else self.scale[...]
        if self.promote_dtype is not None:
            x, scale = self.promote_dtype((x, scale), dtype=self.dtype)
        return rms_norm(x, scale, eps=self.eps, offset=self.offset, casting=self.casting, impl=self.impl)

    def add(self, x: jax.Array, residual: jax.Array, *, residual_dtype=None) -> tuple[jax.Array, jax.Array]:
        """The fused residual add: ``(y, h)`` with ``h = r(x + residual)`` and ``y = self(h)``, one kernel per
        direction (``pallas_norm.rms_norm_add``; ``promote_dtype`` is not applied: x's dtype rules)."""
        if getattr(x, "shape", (None,))[-1:] != (self.num_features,):
            raise ValueError(f"x's last axis must be num_features={self.num_features}, got shape "
                             f"{tuple(getattr(x, 'shape', ()))}")
        scale = None if self.scale is None else self.scale[...]
        return rms_norm_add(x, residual, scale, eps=self.eps, offset=self.offset, casting=self.casting,
                            residual_dtype=residual_dtype, impl=self.impl)


def _replaceable(module: nnx.RMSNorm) -> str | None:
    """Why ``module`` (a ``flax.nnx.RMSNorm``) cannot be replaced, or None."""
    if module.axis_name is not None:
        return "cross-device statistics (axis_name)"
    if not all(axes in (-1, (-1,), [-1]) for axes in (module.reduction_axes, module.feature_axes)):
        return "normalises other axes than the last"
    return None


def _replacement(module: nnx.RMSNorm, impl: str | None) -> RMSNorm:
    """Ours computing Flax's formula (float32, one rounding: casting "gemma", offset 0) with Flax's dtype rules and
    the same ``scale`` Param object."""
    new = RMSNorm(module.num_features, eps=float(module.epsilon), offset=0.0, casting="gemma",
                  param_dtype=module.param_dtype, use_scale=module.scale is not None, impl=impl, dtype=module.dtype,
                  promote_dtype=module.promote_dtype)
    if module.scale is not None:
        new.scale = module.scale
    return new


def _outputs(module: nnx.Module, x: jax.Array, w: jax.Array | None, dy: jax.Array) -> list[np.ndarray | None]:
    """``(y, dx, dweight)`` of ``module`` with ``scale = w`` on a copy (the module's own state is untouched)."""
    graphdef, state = nnx.split(nnx.clone(module))
    if w is not None:
        state["scale"].set_value(w)

    def run(x, state):
        return nnx.merge(graphdef, state)(x)

    y, vjp = jax.vjp(run, x, state)
    dx, dstate = vjp(dy.astype(y.dtype))
    dw = None if w is None else dstate["scale"].get_value()
    return [None if a is None else np.asarray(a) for a in (y, dx, dw)]


def _probe_failure(original: nnx.RMSNorm, new: RMSNorm) -> str | None:
    """Both modules on a random probe, forward and backward, held to the accuracy rule of the mode the patch
    assumes: ours (y, dx, dweight) to the bound, the original's ``y`` to the bound and the naive formula's
    rounding points, so a wrong mode fails. (Flax's own bf16 ``dx`` sums two bf16 cotangents, an extra rounding
    the rule does not allow: it is not judged.)"""
    dt = jnp.dtype(original.dtype or original.param_dtype)
    x, w, dy = accuracy.make_inputs((8, original.num_features), dt, 0.0, scale=2.0, seed=0)
    if original.scale is None:
        w = None
    else:
        w = (np.asarray(original.scale[...], np.float32) + 0.1 * w.astype(np.float32)).astype(original.param_dtype)
    ours, theirs = (_outputs(m, jnp.asarray(x), None if w is None else jnp.asarray(w), jnp.asarray(dy))
                    for m in (new, original))
    if ours[0].dtype != x.dtype:  # promoted to a wider dtype: judged in that dtype, where nothing is rounded
        x, dy = x.astype(ours[0].dtype), dy.astype(ours[0].dtype)
    ref = accuracy.reference(x, w, dy, eps=new.eps, offset=new.offset, casting=new.casting)
    failures = (ref.failures("", ours, only=("y", "dx") if w is None else accuracy.OUTPUTS, rounding_points=False)
                + ref.failures("original", theirs, only=("y",)))
    return failures[0] if failures else None


def _set(model: nnx.Module, path: tuple, module: nnx.Module) -> None:
    parent = model
    for key in path[:-1]:
        parent = getattr(parent, key) if isinstance(key, str) else parent[key]
    if isinstance(path[-1], str) and not isinstance(parent, nnx.Dict):
        setattr(parent, path[-1], module)
    else:
        parent[path[-1]] = module


def patch_model(model: nnx.Module, *, verify: bool = True, impl: str | None = None) -> list[str]:
    """Replace every ``flax.nnx.RMSNorm`` of an NNX ``model`` by ``pallas_norm.nnx.RMSNorm`` computing the same
    formula (``x·rsqrt(mean(x²) + epsilon)·scale`` in float32, one rounding; Flax's dtype promotion) with the same
    ``scale`` Param objects, so optimizer states and checkpoints keep working. Returns the replaced paths.

    Modules whose options this library does not implement (statistics over other axes than the last, across
    devices) are left alone with one warning. ``verify``: each replacement is first checked against the module
    it replaces on a random probe, forward and backward (``pallas_norm.accuracy``); on a mismatch nothing stays
    patched and a RuntimeError names the module and the error.
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"model must be a flax.nnx.Module, got {type(model).__name__}")
    if not isinstance(verify, bool):
        raise TypeError(f"verify must be a bool, got {type(verify).__name__}")
    if impl is not None:
        resolve_impl(impl)
    found = [(path, m) for path, m in nnx.iter_modules(model) if type(m) is nnx.RMSNorm]
    patched, left = [], {}
    for path, module in found:
        reason = _replaceable(module)
        name = ".".join(map(str, path))
        if reason:
            left[name] = reason
            continue
        new = _replacement(module, impl)
        failure = _probe_failure(module, new) if verify else None
        if failure:
            for done_path, original in patched:
                _set(model, done_path, original)
            raise RuntimeError(f"patch_model: {name} (flax.nnx.RMSNorm -> pallas_norm.nnx.RMSNorm) disagrees with "
                               f"the original: {failure}")
        _set(model, path, new)
        patched.append((path, module))
    if left:
        warnings.warn("patch_model: left unpatched: " + "; ".join(f"{k} ({v})" for k, v in left.items()),
                      UserWarning, stacklevel=2)
    return [".".join(map(str, path)) for path, _ in patched]
