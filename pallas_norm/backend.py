"""Everything specific to the Pallas GPU lowering in use: Pallas's Triton backend.

Kernels in ``kernels.py`` touch memory only through ``load``/``store`` below and get launch settings from
``compiler_params``; a Mosaic GPU lowering would replace this module. Pallas's Triton module is imported on
first use, so ``impl="xla"`` never loads it.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp

from . import compat

# The Pallas Triton backend is deprecated since JAX 0.11 (still shipped in 0.12); Mosaic GPU is its successor.
# Silence exactly that one warning, here and nowhere else.
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning)


@functools.cache
def _pl_triton():
    from jax.experimental.pallas import triton

    return triton


def load(ref, mask: jnp.ndarray, *, other: float = 0.0) -> jnp.ndarray:
    """Masked load of ``ref`` (already indexed with ``.at[...]``); masked-off lanes read ``other``."""
    return _pl_triton().load(ref, mask=mask, other=other)


def store(ref, value: jnp.ndarray, mask: jnp.ndarray) -> None:
    """Masked store of ``value`` into ``ref`` (already indexed with ``.at[...]``)."""
    _pl_triton().store(ref, value, mask=mask)


def compiler_params(num_warps: int, num_stages: int | None = None, *, interpret: bool = False):
    """Launch settings for one ``pallas_call``; compiled kernels also get the rounding primitive's lowering."""
    if not interpret:
        compat.register_round_to_lowering()
    return _pl_triton().CompilerParams(num_warps=num_warps, num_stages=num_stages)


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
