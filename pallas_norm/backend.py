"""Everything specific to the Pallas GPU lowering in use: Pallas's Triton backend.

Kernels in ``kernels.py`` touch memory only through ``load``/``store`` below and get launch settings from
``compiler_params``; a Mosaic GPU lowering would replace this module.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as pl_triton

# The Pallas Triton backend is deprecated since JAX 0.11 (still shipped in 0.12); Mosaic GPU is its successor
# and a later issue adds that lowering. Silence exactly that one warning, here and nowhere else.
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning)


def load(ref, mask: jnp.ndarray, *, other: float = 0.0) -> jnp.ndarray:
    """Masked load of ``ref`` (already indexed with ``.at[...]``); masked-off lanes read ``other``."""
    return pl_triton.load(ref, mask=mask, other=other)


def store(ref, value: jnp.ndarray, mask: jnp.ndarray) -> None:
    """Masked store of ``value`` into ``ref`` (already indexed with ``.at[...]``)."""
    pl_triton.store(ref, value, mask=mask)


def compiler_params(num_warps: int, num_stages: int | None = None) -> pl_triton.CompilerParams:
    """Launch settings for one ``pallas_call``."""
    return pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


@functools.lru_cache(maxsize=None)
def num_sms() -> int:
    """Streaming multiprocessors of the default GPU (8 where there is none, e.g. the CPU interpreter)."""
    device = jax.devices()[0]
    if device.platform != "gpu":
        return 8
    return int(getattr(device, "core_count", 0) or 132)


def on_gpu() -> bool:
    """Whether JAX's default backend is a GPU (where ``impl=None`` picks the Pallas kernel)."""
    return jax.default_backend() == "gpu"


def _register_round_to_lowering() -> None:
    """Lower ``rounding.round_to_p`` inside Triton kernels as a convert round trip (hardware nearest-even,
    subnormals kept), which Triton, unlike XLA, never deletes."""
    from jax._src.pallas.triton import lowering as tl

    from .rounding import round_to_p

    @tl.register_lowering(round_to_p)
    def _rule(ctx, v, *, dtype):
        [aval] = ctx.avals_in
        cc = ctx.context.compute_capability
        narrow = tl._cast(v, aval.dtype, dtype, compute_capability=cc)
        return tl._cast(narrow, dtype, aval.dtype, compute_capability=cc)


_register_round_to_lowering()
