"""``rms_norm``: the public JAX entry point, a ``jax.custom_vjp`` around the Pallas kernels (or the XLA path)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from . import backend, kernels, reference, sharding
from .checks import check_inputs
from .plan import make_plan

IMPLS: tuple[str, ...] = ("pallas", "xla", "interpret")


def resolve_impl(impl: object) -> str:
    """``None`` → ``"pallas"`` on a GPU, ``"xla"`` elsewhere; validates explicit choices."""
    if impl is None:
        return "pallas" if backend.on_gpu() else "xla"
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ValueError(f"impl must be None or one of {IMPLS}, got {impl!r}")
    if impl == "pallas" and not backend.on_gpu():
        raise ValueError("impl='pallas' needs a GPU (JAX's default backend is "
                         f"{jax.default_backend()!r}); use impl='interpret' to run the kernel on CPU")
    return impl


def rms_norm(
    x: jax.Array,
    weight: jax.Array | None = None,
    *,
    eps: float = 1e-6,
    offset: float = 0.0,
    casting: str = "llama",
    impl: str | None = None,
) -> jax.Array:
    """RMSNorm over the last axis: ``y = x · rsqrt(mean(x²) + eps) · (weight + offset)``, dtype ``x.dtype``.

    ``rstd = rsqrt(mean(x32²) + eps)`` is always float32. ``casting`` fixes where values are rounded to
    ``x.dtype`` (full formulas in ``docs/semantics.md``):

    - ``"llama"`` (HF Llama/Mistral/Qwen): ``n = r(x32·rstd)``; ``y = r(n · (weight + offset))``.
    - ``"gemma"`` (HF Gemma, with ``offset=1``): ``y = r(x32·rstd·(offset + weight32))``, one rounding.
    - ``"none"`` (Liger's "none"): ``rstd`` rounded to ``x.dtype``, then ``x·rstd·(weight + offset)`` with
      every product in ``x.dtype``.

    ``weight=None`` means no scale (``offset`` must then be 0). ``impl``: ``None`` (the Pallas kernel on GPU,
    the XLA path elsewhere), ``"pallas"``, ``"xla"``, or ``"interpret"`` (the Pallas kernel run by Pallas's
    interpreter, on any backend). Differentiable (custom VJP: ``dx`` and float32-accumulated, deterministic
    ``dweight``), and works under ``jit``, ``vmap`` and ``jax.checkpoint``. The cotangent is never written.

    Sharded ``x`` (``pallas_norm/sharding.py``): rows (leading axes) may be sharded over mesh axes; each device
    normalises its own rows, nothing is gathered, ``y``/``dx`` keep ``x``'s sharding and ``dweight`` is summed
    over the row shards. The hidden (last) axis must be whole on every device: sharding it is refused with a
    message naming the mesh axis and the fix (reshard with ``jax.lax.with_sharding_constraint(x, P(..., None))``):
    a ``ValueError`` while tracing (Explicit mesh axes), or at compile time a ``jax.errors.JaxRuntimeError``
    carrying it (Auto axes, whose shardings only XLA's partitioner knows).
    """
    x, weight, eps, offset, casting = check_inputs(x, weight, eps, offset, casting)
    return _rms_norm(x, weight, eps, offset, casting, resolve_impl(impl))


def rms_norm_with_rstd(x, weight=None, *, eps=1e-6, offset=0.0, casting="llama", impl=None):
    """Forward only: ``(y, rstd)`` with ``rstd`` float32 of shape ``x.shape[:-1]`` (not differentiable)."""
    x, weight, eps, offset, casting = check_inputs(x, weight, eps, offset, casting)
    y, (_, _, rstd) = _rms_norm_fwd(x, weight, eps, offset, casting, resolve_impl(impl))
    return y, rstd


def _opt(weight):
    return () if weight is None else (weight,)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _rms_norm(x, weight, eps, offset, casting, impl):
    return _rms_norm_fwd(x, weight, eps, offset, casting, impl)[0]


def _rms_norm_fwd(x, weight, eps, offset, casting, impl):
    has_weight = weight is not None
    y, rstd = sharding.forward(forward_fn(eps, offset, casting, impl), has_weight)(x, *_opt(weight))
    return y, (x, weight, rstd)


def _rms_norm_bwd(eps, offset, casting, impl, residuals, dy):
    x, weight, rstd = residuals
    has_weight = weight is not None
    bwd = sharding.backward(backward_fn(offset, casting, impl, has_weight), has_weight)
    return bwd(x, *_opt(weight), dy, rstd)


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


def _forward_2d(x2, weight, *, eps, offset, casting, impl):
    m, n = x2.shape
    if impl == "xla":
        return reference.forward_2d(x2, weight, eps=eps, offset=offset, casting=casting)
    if m == 0:
        return jnp.zeros((0, n), x2.dtype), jnp.zeros((0,), jnp.float32)
    return kernels.forward(x2, weight, eps=eps, offset=offset, casting=casting, plan=make_plan(m, n),
                           interpret=impl == "interpret")


def _backward_2d(x2, weight, dy2, rstd, *, offset, casting, impl):
    m, n = x2.shape
    if impl == "xla":
        return reference.backward_2d(x2, weight, dy2, rstd, offset=offset, casting=casting)
    if m == 0:
        return jnp.zeros((0, n), x2.dtype), None if weight is None else jnp.zeros((n,), weight.dtype)
    return kernels.backward(x2, weight, dy2, rstd, offset=offset, casting=casting,
                            plan=make_plan(m, n, backward=True), interpret=impl == "interpret")


@functools.lru_cache(maxsize=None)
def forward_fn(eps, offset, casting, impl):
    """``f(x2, *weight) -> (y, rstd)`` on 2-D ``x2``; under ``vmap`` the batch axis is folded into the rows (one
    launch). The custom VJP and the torch bridge both run exactly this function, hence identical bits."""

    def fwd(x2, *w):
        return _forward_2d(x2, w[0] if w else None, eps=eps, offset=offset, casting=casting, impl=impl)

    if impl == "xla":
        return fwd
    f = jax.custom_batching.custom_vmap(fwd)

    @f.def_vmap
    def _rule(axis_size, in_batched, x2, *w):
        if w and in_batched[1]:  # per-example weights: one launch per example
            x2 = x2 if in_batched[0] else jnp.broadcast_to(x2, (axis_size, *x2.shape))
            return lax.map(lambda a: f(*a), (x2, *w)), (True, True)
        b, m, n = x2.shape
        y, rstd = f(x2.reshape(b * m, n), *w)
        return (y.reshape(b, m, n), rstd.reshape(b, m)), (True, True)

    return f


@functools.lru_cache(maxsize=None)
def backward_fn(offset, casting, impl, has_weight):
    """``f(x2, *weight, dy2, rstd) -> (dx, dweight)``; under ``vmap`` rows are folded when there is no weight,
    else each example runs its own launch (each needs its own ``dweight``)."""

    def bwd(x2, *rest):
        w = rest[0] if has_weight else None
        dy2, rstd = rest[-2:]
        return _backward_2d(x2, w, dy2, rstd, offset=offset, casting=casting, impl=impl)

    if impl == "xla":
        return bwd
    f = jax.custom_batching.custom_vmap(bwd)

    @f.def_vmap
    def _rule(axis_size, in_batched, *args):
        args = [a if b else jnp.broadcast_to(a, (axis_size, *a.shape)) for a, b in zip(args, in_batched)]
        if has_weight:
            return lax.map(lambda a: f(*a), tuple(args)), (True, True)
        x2, dy2, rstd = args
        b, m, n = x2.shape
        dx, _ = f(x2.reshape(b * m, n), dy2.reshape(b * m, n), rstd.reshape(b * m))
        return (dx.reshape(b, m, n), None), (True, None)

    return f
