"""Everything specific to the Pallas GPU lowerings: Pallas's Triton backend and Mosaic GPU.

Kernels in ``kernels.py`` touch memory only through ``load``/``store`` below and get launch settings from
``compiler_params``. The Mosaic GPU kernels (``mosaic_kernels.py``) get their module, compiler parameters and
interpreter from ``mosaic``/``mosaic_params``/``mosaic_interpret``. Both are imported on first use, so
``impl="xla"`` never loads either.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp

from . import compat
from .rounding import rounder

# The Pallas Triton backend is deprecated since JAX 0.11 (still shipped in 0.12); Mosaic GPU is its successor.
# Silence exactly that one warning, here and nowhere else.
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning)


@functools.cache
def _pl_triton():
    from jax.experimental.pallas import triton

    return triton


def load(ref, mask: jnp.ndarray, *, other: float = 0.0, eviction: str | None = None,
         volatile: bool = False) -> jnp.ndarray:
    """Masked load of ``ref`` (already indexed with ``.at[...]``); masked-off lanes read ``other``. ``eviction``:
    the L2 policy (``"evict_last"``: keep for a second read soon, ``"evict_first"``: last use); ``volatile``: read
    memory every time, never a cached copy (for polling what other programs write)."""
    return _pl_triton().load(ref, mask=mask, other=other, eviction_policy=eviction, volatile=volatile)


def store(ref, value: jnp.ndarray, mask: jnp.ndarray) -> None:
    """Masked store of ``value`` into ``ref`` (already indexed with ``.at[...]``)."""
    _pl_triton().store(ref, value, mask=mask)


def ordered_sum(load: Callable[[int | jax.Array, int], jax.Array], count: int, step: int,
                acc: jax.Array) -> jax.Array:
    """``acc`` plus the rows 0, 1, …, count - 1 added in that order (the same bits every run), inside a kernel of
    either lowering: a ``fori_loop`` whose body issues ``step`` loads before adding them in order (neither lowering
    unrolls or pipelines such a chain of loads: this keeps ``step`` of them in flight), then the remainder.
    ``load(first, j)`` loads row ``first + j`` (the caller writes the index, offset as it needs). Both lowerings'
    dweight reductions sum their partial rows with it."""

    def add(first: int | jax.Array, n: int, total: jax.Array) -> jax.Array:
        loaded = [load(first, j) for j in range(n)]
        for value in loaded:
            total = total + value
        return total

    steps = count // step
    acc = jax.lax.fori_loop(0, steps, lambda i, total: add(i * step, step, total), acc)
    return add(steps * step, count - steps * step, acc)


def _ptx(code: str, args: list, constraints: str, pack: int, dtype) -> jnp.ndarray:
    """``code`` applied elementwise to ``args`` (same shapes), ``pack`` elements per instance (16-bit values packed
    two to a 32-bit register; 32-bit ones one per operand), one result of ``dtype``."""
    return _pl_triton().elementwise_inline_asm(code, args=args, constraints=constraints, pack=pack,
                                               result_shape_dtypes=[jax.ShapeDtypeStruct(args[0].shape, dtype)])[0]


@dataclasses.dataclass(frozen=True)
class RowOps:
    """How a kernel widens a tile to float32, rounds float32 values to the row dtype and back (``r``), and forms
    ``a·b + c``. ``plain`` (the interpreter, and every dtype but bf16): ``astype``, ``rounding.rounder``,
    ``a * b + c``; ``pairs`` (bf16 rows in a compiled Triton kernel): PTX on pairs of elements, the same bits for the
    first two (a bf16 pair widened by one ``shl`` and one ``and`` where LLVM extracts the high half first, 3
    instructions for 2; ``r`` one ``cvt.rn.bf16x2.f32`` for 2; tiles of an odd last dimension: ``plain``'s),
    ``fma.rn.f32`` for the third (one rounding, not two: other bits, within float32's)."""

    widen: Callable
    round: Callable
    mul_add: Callable
    fused: bool


def _pairs(t) -> bool:
    """Whether a tile's elements pair up: an even last dimension (a column of per-row values, e.g. rstd of shape
    ``(rows, 1)``, does not: Triton asks the element count to be a multiple of ``pack``)."""
    return t.ndim > 0 and t.shape[-1] % 2 == 0


def _widen_bf16_pairs(t):
    if t.dtype != jnp.bfloat16 or not _pairs(t):
        return t.astype(jnp.float32)
    return _ptx("shl.b32 $0, $2, 16;\n\tand.b32 $1, $2, 0xffff0000;", [t], "=r,=r,r", 2, jnp.float32)


def _round_bf16_pairs(v):
    if not _pairs(v):
        return rounder(jnp.bfloat16)(v)
    return _ptx("{\n\t.reg .b32 t;\n\tcvt.rn.bf16x2.f32 t, $3, $2;\n\tshl.b32 $0, t, 16;\n\t"
                "and.b32 $1, t, 0xffff0000;\n\t}", [v], "=r,=r,r,r", 2, jnp.float32)


def _fma_f32(a, b, c):
    a, b, c = jnp.broadcast_arrays(a, b, c)
    return _ptx("fma.rn.f32 $0, $1, $2, $3;", [a, b, c], "=r,r,r,r", 1, jnp.float32)


def plain_ops(dt) -> RowOps:
    """``RowOps``' ``plain`` for rows of dtype ``dt``: ``astype``, ``rounding.rounder``, ``a * b + c``."""
    return RowOps(lambda t: t.astype(jnp.float32), rounder(dt), lambda a, b, c: a * b + c, False)


def row_ops(dt, *, interpret: bool) -> RowOps:
    """``RowOps`` for rows of dtype ``dt``: ``pairs`` for bf16 compiled (for a GPU of compute capability 8.0 or more,
    ``cvt.rn.bf16x2.f32``'s; or none known: lowered without one), else ``plain_ops``."""
    if interpret or jnp.dtype(dt) != jnp.dtype(jnp.bfloat16) or 0 < compute_capability() < 80:
        return plain_ops(dt)
    return RowOps(_widen_bf16_pairs, _round_bf16_pairs, _fma_f32, True)


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


def model_slug(name: str) -> str:
    """A GPU model's short name from its device name: "NVIDIA H100 80GB HBM3" -> "h100", "NVIDIA H200" -> "h200"."""
    words = re.sub(r"^nvidia\s+", "", name.strip().lower()).split()
    return re.sub(r"[^a-z0-9]+", "-", words[0] if words else "gpu")


@functools.lru_cache(maxsize=None)
def gpu_model() -> str:
    """The default GPU's model (``model_slug`` of its device kind; "" off a GPU): the key of the per-model tables,
    e.g. ``ffi_tables.FWD_FFI_ALL_ROWS``."""
    device = jax.devices()[0]
    return model_slug(device.device_kind) if device.platform == "gpu" else ""


def on_gpu() -> bool:
    """Whether JAX's default backend is a GPU (where ``impl=None`` picks the Pallas kernel)."""
    return jax.default_backend() == "gpu"


MOSAIC_MIN_JAX = (0, 11)  # plgpu.kernel, the GPU interpreter (InterpretGPUParams), cluster_ref


@functools.cache
def mosaic():
    """``jax.experimental.pallas.mosaic_gpu`` (``plgpu``), version-guarded."""
    if tuple(jax.__version_info__[:2]) < MOSAIC_MIN_JAX:
        raise RuntimeError(f"impl='mosaic' needs jax >= {'.'.join(map(str, MOSAIC_MIN_JAX))} (Mosaic GPU's "
                           f"plgpu.kernel and interpreter), got jax {jax.__version__}")
    from jax.experimental.pallas import mosaic_gpu

    return mosaic_gpu


def mosaic_params(*, interpret: bool):
    """Compiler parameters of the Mosaic kernels (lane-level lowering: layouts are the kernels' own); compiled
    kernels also get the rounding primitive's lowering."""
    plgpu = mosaic()
    if not interpret:
        compat.register_round_to_mosaic_lowering()
    return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)


def mosaic_interpret(interpret: bool):
    """The ``interpret=`` argument of ``plgpu.kernel``: Mosaic GPU's interpreter (any backend) or None."""
    return mosaic().InterpretGPUParams() if interpret else None


def compute_capability() -> int:
    """JAX's default device's compute capability as ``10·major + minor`` (90 for an H100); 0 off a GPU or where the
    device reports none (e.g. ROCm)."""
    device = jax.devices()[0]
    cc = getattr(device, "compute_capability", None)
    if device.platform != "gpu" or not cc:
        return 0
    try:
        major, _, minor = str(cc).partition(".")
        return int(major) * 10 + int(minor or 0)
    except ValueError:
        return 0


def mosaic_capable() -> bool:
    """Whether JAX's default device can run Mosaic GPU kernels (an NVIDIA GPU of compute capability >= 9.0)."""
    return compute_capability() >= 90
