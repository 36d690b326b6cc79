"""``rms_norm``: the public JAX entry point, a ``jax.custom_vjp`` around the Pallas kernels (or the XLA path)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from . import auto, backend, bands, kernels, mosaic, pallas_config, registry, sharding, xla
from .checks import check_inputs
from .mosaic_config import MosaicConfig
from .pallas_config import Config

IMPLS: tuple[str, ...] = registry.JAX_IMPLS


def resolve_impl(impl: object) -> str:
    """``None`` → ``"auto"`` on a GPU (per direction and shape the faster lowering: ``auto.py``), ``"xla"``
    elsewhere; validates explicit choices."""
    if impl is None:
        return "auto" if backend.on_gpu() else "xla"
    impl = registry.jax_impl(impl)
    if impl in ("pallas", "auto") and not backend.on_gpu():
        raise ValueError(f"impl={impl!r} needs a GPU (JAX's default backend is "
                         f"{jax.default_backend()!r}); use impl='interpret' to run the kernel on CPU")
    if impl == "mosaic" and not backend.mosaic_capable():
        raise ValueError("impl='mosaic' needs an NVIDIA GPU of compute capability >= 9.0 (Hopper or newer; JAX's "
                         f"default device is {jax.devices()[0].device_kind!r}); use impl='pallas' there, or "
                         "impl='mosaic_interpret' to run the Mosaic kernels on CPU")
    return impl


def _is_mosaic(impl: str) -> bool:
    return impl in registry.KERNEL_FORMS["mosaic"]


def _local_only(impl: str) -> bool:
    """Mosaic GPU's interpreter runs on host callbacks that cannot be partitioned: its calls stay unsharded."""
    return impl == "mosaic_interpret"


def check_configs(impl: str, **configs: object) -> None:
    """``config``/``bwd_config`` tile the kernels: ``pallas_config.Config`` for ``pallas``/``interpret``,
    ``mosaic_config.MosaicConfig`` for ``mosaic``/``mosaic_interpret``, either for ``auto`` (it then picks that
    direction's lowering), None for any."""
    for name, config in configs.items():
        if config is None:
            continue
        if impl == "xla":
            raise ValueError(f"{name} tiles the Pallas kernels; impl='xla' takes none (got {config}; impl=None is "
                             "'xla' where JAX sees no GPU: pass impl='interpret' to tile the interpreted kernels)")
        allowed = (Config, MosaicConfig) if impl == "auto" else (MosaicConfig,) if _is_mosaic(impl) else (Config,)
        if not isinstance(config, allowed):
            names = " or ".join(f"pallas_norm.{c.__module__.rsplit('.', 1)[-1]}.{c.__name__}" for c in allowed)
            raise TypeError(f"{name} must be a {names} or None for impl={impl!r}, got {type(config).__name__}")


def rms_norm(
    x: jax.Array,
    weight: jax.Array | None = None,
    *,
    eps: float = 1e-6,
    offset: float = 0.0,
    casting: str = "llama",
    impl: str | None = None,
    config: Config | None = None,
    bwd_config: Config | None = None,
) -> jax.Array:
    """RMSNorm over the last axis: ``y = x · rsqrt(mean(x²) + eps) · (weight + offset)``, dtype ``x.dtype``.

    ``rstd = rsqrt(mean(x32²) + eps)`` is always float32. ``casting`` fixes where values are rounded to
    ``x.dtype`` (full formulas in ``docs/semantics.md``):

    - ``"llama"`` (HF Llama/Mistral/Qwen): ``n = r(x32·rstd)``; ``y = r(n · (weight + offset))``.
    - ``"gemma"`` (HF Gemma, with ``offset=1``): ``y = r(x32·rstd·(offset + weight32))``, one rounding.
    - ``"none"`` (Liger's "none"): ``rstd`` rounded to ``x.dtype``, then ``x·rstd·(weight + offset)`` with
      every product in ``x.dtype``.

    ``weight=None`` means no scale (``offset`` must then be 0). ``impl``: ``None`` (``"auto"`` on GPU: per
    direction and shape the faster lowering of the kernels, ``pallas_norm/auto.py``; the XLA path elsewhere),
    ``"pallas"`` (the Triton lowering), ``"xla"``, ``"interpret"`` (the Pallas kernel run by Pallas's
    interpreter, on any backend), ``"mosaic"`` (the Mosaic GPU kernels: Hopper GPUs; rows up to 262144 columns in
    the backward) or ``"mosaic_interpret"`` (those run by Mosaic GPU's interpreter). ``config``/``bwd_config``
    force the kernels' tiling for the forward and the backward (``pallas_norm.pallas_config.Config``, or
    ``pallas_norm.mosaic_config.MosaicConfig`` for the Mosaic kernels; None: the heuristic). Differentiable
    (custom VJP: ``dx`` and float32-accumulated, deterministic ``dweight``), and works under ``jit``, ``vmap``
    and ``jax.checkpoint``. The cotangent is never written.

    Sharded ``x`` (``pallas_norm/sharding.py``): rows (leading axes) may be sharded over mesh axes; each device
    normalises its own rows, nothing is gathered, ``y``/``dx`` keep ``x``'s sharding and ``dweight`` is summed
    over the row shards. The hidden (last) axis must be whole on every device: sharding it is refused with a
    message naming the mesh axis and the fix (reshard with ``jax.lax.with_sharding_constraint(x, P(..., None))``):
    a ``ValueError`` while tracing (Explicit mesh axes), or at compile time a ``jax.errors.JaxRuntimeError``
    carrying it (Auto axes, whose shardings only XLA's partitioner knows).
    """
    x, weight, eps, offset, casting = check_inputs(x, weight, eps, offset, casting)
    impl = resolve_impl(impl)
    check_configs(impl, config=config, bwd_config=bwd_config)
    return _rms_norm(x, weight, eps, offset, casting, impl, config, bwd_config)


def rms_norm_with_rstd(x, weight=None, *, eps=1e-6, offset=0.0, casting="llama", impl=None, config=None):
    """Forward only: ``(y, rstd)`` with ``rstd`` float32 of shape ``x.shape[:-1]`` (not differentiable)."""
    x, weight, eps, offset, casting = check_inputs(x, weight, eps, offset, casting)
    impl = resolve_impl(impl)
    check_configs(impl, config=config)
    y, (_, _, rstd) = _rms_norm_fwd(x, weight, eps, offset, casting, impl, config, None)
    return y, rstd


def _opt(weight):
    return () if weight is None else (weight,)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6, 7))
def _rms_norm(x, weight, eps, offset, casting, impl, config, bwd_config):
    return _rms_norm_fwd(x, weight, eps, offset, casting, impl, config, bwd_config)[0]


def _rms_norm_fwd(x, weight, eps, offset, casting, impl, config, bwd_config):
    has_weight = weight is not None
    fwd = sharding.forward(forward_fn(eps, offset, casting, impl, config), has_weight, local_only=_local_only(impl))
    y, rstd = fwd(x, *_opt(weight))
    return y, (x, weight, rstd)


def _rms_norm_bwd(eps, offset, casting, impl, config, bwd_config, residuals, dy):
    x, weight, rstd = residuals
    has_weight = weight is not None
    bwd = sharding.backward(backward_fn(offset, casting, impl, has_weight, bwd_config), has_weight,
                            local_only=_local_only(impl))
    return bwd(x, *_opt(weight), dy, rstd)


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


def _forward_2d(x2, weight, *, eps, offset, casting, impl, config, residual=None, h_dtype=None):
    """One forward launch on 2-D ``x2`` by ``impl`` (the XLA path, the Pallas kernels or the Mosaic kernels)."""
    m, n = x2.shape
    dt = jnp.dtype(h_dtype or x2.dtype)  # the rows normalised: the fused add's tile is rms_norm(h)'s (its y's bits)
    low = kernels.product_in_dtype(None if weight is None else weight.dtype, dt, casting, offset)
    if impl == "auto":
        f32 = weight is not None and not low  # the weight's product taken in float32
        impl = auto.lowering(False, n, config, m=m, itemsize=dt.itemsize, float32_product=f32)
    fused = dict(residual=residual, h_dtype=h_dtype) if residual is not None else {}
    if impl == "xla":
        return xla.forward_2d(x2, weight, eps=eps, offset=offset, casting=casting, **fused)
    if m == 0:  # the kernels see at least one row
        rows = (jnp.zeros((0, n), h_dtype or x2.dtype),) * (1 + bool(fused))
        return *rows, jnp.zeros((0,), jnp.float32)
    if _is_mosaic(impl):
        return mosaic.forward(x2, weight, eps=eps, offset=offset, casting=casting, config=config,
                              interpret=impl == "mosaic_interpret", **fused)
    config = pallas_config.fit(config, m, n, backward=False, fused=residual is not None, itemsize=dt.itemsize,
                               product_in_dtype=low)
    launch = bands.forward if config.lag else kernels.forward
    return launch(x2, weight, eps=eps, offset=offset, casting=casting, config=config, interpret=impl == "interpret",
                  **fused)


def _backward_2d(x2, weight, dy2, rstd, *, offset, casting, impl, config, dh_out=None):
    m, n = x2.shape
    if impl == "auto":
        impl = auto.lowering(True, n, config, m=m, itemsize=x2.dtype.itemsize)
    if impl == "xla":
        return xla.backward_2d(x2, weight, dy2, rstd, offset=offset, casting=casting, dh_out=dh_out)
    if m == 0:
        return jnp.zeros((0, n), x2.dtype), None if weight is None else jnp.zeros((n,), weight.dtype)
    if _is_mosaic(impl):
        return mosaic.backward(x2, weight, dy2, rstd, offset=offset, casting=casting, dh_out=dh_out, config=config,
                               interpret=impl == "mosaic_interpret")
    config = pallas_config.fit(config, m, n, backward=True, fused=dh_out is not None, itemsize=x2.dtype.itemsize)
    launch = bands.backward if config.lag else kernels.backward
    return launch(x2, weight, dy2, rstd, offset=offset, casting=casting, dh_out=dh_out, config=config,
                  interpret=impl == "interpret")


def _broadcast(args, in_batched, axis_size):
    return [a if b else jnp.broadcast_to(a, (axis_size, *a.shape)) for a, b in zip(args, in_batched)]


@functools.lru_cache(maxsize=None)
def forward_fn(eps, offset, casting, impl, config: Config | None = None, h_dtype=None):
    """``f(x2, *weight) -> (y, rstd)`` on 2-D ``x2``; under ``vmap`` the batch axis is folded into the rows (one
    launch). The custom VJP and the torch bridge both run exactly this function, hence identical bits. With
    ``h_dtype`` (the fused add): ``f(x2, residual2, *weight) -> (y, h, rstd)``, ``h = r(x + residual)`` in
    ``h_dtype``."""
    k = 1 if h_dtype is None else 2  # row operands (x[, residual]), and row results besides rstd (y[, h])

    def fwd(*args):
        w = args[k:]
        extra = {} if k == 1 else dict(residual=args[1], h_dtype=h_dtype)
        return _forward_2d(args[0], w[0] if w else None, eps=eps, offset=offset, casting=casting, impl=impl,
                           config=config, **extra)

    if impl == "xla":
        return fwd
    f = jax.custom_batching.custom_vmap(fwd)

    @f.def_vmap
    def _rule(axis_size, in_batched, *args):
        if len(args) > k and in_batched[k]:  # per-example weights: one launch per example
            rows = _broadcast(args[:k], in_batched, axis_size)
            return lax.map(lambda a: f(*a), (*rows, *args[k:])), (True,) * (k + 1)
        rows = _broadcast(args[:k], in_batched, axis_size)
        b, m, n = rows[0].shape
        outs = f(*(a.reshape(b * m, n) for a in rows), *args[k:])
        return (*(o.reshape(b, m, n) for o in outs[:k]), outs[k].reshape(b, m)), (True,) * (k + 1)

    return f


@functools.lru_cache(maxsize=None)
def backward_fn(offset, casting, impl, has_weight, config: Config | None = None, fused: bool = False):
    """``f(x2, *weight, dy2, rstd) -> (dx, dweight)``; under ``vmap`` rows are folded when there is no weight,
    else each example runs its own launch (each needs its own ``dweight``). ``fused`` (the fused add's backward,
    ``x2`` being ``h``): ``f(h2, *weight, dy2, dh_out2, rstd) -> (dh, dweight)``, ``dh = r(dx_norm + dh_out)``."""

    def bwd(x2, *rest):
        w = rest[0] if has_weight else None
        dy2, rstd = rest[has_weight], rest[-1]
        extra = dict(dh_out=rest[has_weight + 1]) if fused else {}
        return _backward_2d(x2, w, dy2, rstd, offset=offset, casting=casting, impl=impl, config=config, **extra)

    if impl == "xla":
        return bwd
    f = jax.custom_batching.custom_vmap(bwd)

    @f.def_vmap
    def _rule(axis_size, in_batched, *args):
        args = _broadcast(args, in_batched, axis_size)
        if has_weight:
            return lax.map(lambda a: f(*a), tuple(args)), (True, True)
        b, m, n = args[0].shape
        dx, _ = f(*(a.reshape(b * m, n) for a in args[:-1]), args[-1].reshape(b * m))
        return (dx.reshape(b, m, n), None), (True, None)

    return f
