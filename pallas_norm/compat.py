"""The one place that touches JAX's private modules (``jax._src``): lazily, on first use, and version-guarded.

Nothing here runs at import time. ``impl="xla"`` (JAX) and ``backend="triton"`` (torch) never call into it;
the Pallas kernels need :func:`register_round_to_lowering` (Mosaic GPU:
:func:`register_round_to_mosaic_lowering`), the DLPack route may use :func:`dlpack_importer`
(an optional fast path), the launch route needs :func:`mlir`. When a JAX release moves one of these, the error
names the JAX version and the version range this code was written against, instead of an ``AttributeError``
deep inside a call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

TESTED = (0, 11)  # the JAX minor version whose private modules this file was written and tested against
_touched: set[str] = set()


class JaxInternalsMoved(RuntimeError):
    """A private JAX module or function that pallas-norm relies on is not where it was."""


def _tested() -> bool:
    return tuple(jax.__version_info__[:2]) == TESTED


def _private(what: str, load: Callable):
    """``load()`` (which imports from ``jax._src``), or :class:`JaxInternalsMoved` naming ``what`` and versions."""
    _touched.add(what)
    try:
        return load()
    except (ImportError, AttributeError) as err:
        tested = ".".join(map(str, TESTED))
        hint = "" if _tested() else f" (not the tested version: pin jax=={tested}.*)"
        raise JaxInternalsMoved(f"pallas-norm needs {what} from JAX's private modules; it was written against jax "
                                f"{tested}, and jax {jax.__version__} does not have it{hint}: {err}") from err


def touched() -> frozenset[str]:
    """The private features used so far in this process (tests check that XLA/Triton users touch none)."""
    return frozenset(_touched)


@functools.cache
def register_round_to_lowering() -> None:
    """Lower ``rounding.round_to_p`` inside Pallas's Triton kernels as a convert round trip (hardware
    nearest-even, subnormals kept), which Triton, unlike XLA, never deletes. Idempotent."""
    from .rounding import round_to_p

    def load():
        from jax._src.pallas.triton import lowering

        return lowering, lowering.register_lowering, lowering._cast

    tl, register, cast = _private("the Pallas Triton lowering registry (jax._src.pallas.triton.lowering)", load)

    @register(round_to_p)
    def _rule(ctx, v, *, dtype):
        [aval] = ctx.avals_in
        cc = ctx.context.compute_capability
        narrow = cast(v, aval.dtype, dtype, compute_capability=cc)
        return cast(narrow, dtype, aval.dtype, compute_capability=cc)


@functools.cache
def register_round_to_mosaic_lowering() -> None:
    """Lower ``rounding.round_to_p`` inside Mosaic GPU kernels as a convert round trip (``cvt.rn``, subnormals
    kept), as for the Triton kernels. Idempotent."""
    from .rounding import round_to_p

    def load():
        from jax._src.pallas.mosaic_gpu import lowering
        from jax.experimental.mosaic.gpu import utils

        return lowering.register_lowering_rule, lowering._ensure_fa, utils.dtype_to_ir_type

    register, ensure_fa, ir_type = _private("the Mosaic GPU lowering registry (jax._src.pallas.mosaic_gpu.lowering)",
                                            load)
    from jax.experimental.mosaic.gpu import LoweringSemantics

    @register(round_to_p, LoweringSemantics.Lane)
    def _rule(ctx, v, *, dtype):
        [aval] = ctx.avals_in
        return ensure_fa(v, aval.dtype).astype(ir_type(dtype)).astype(ir_type(aval.dtype))


@functools.cache
def mosaic_runtime() -> Callable:
    """``compile(module_bytes, size)`` of Mosaic GPU's runtime in JAX's CUDA plugin (``MosaicGpuCompile``): a
    handle whose entries 0 and 1 are the kernel's function and its launcher ``launch(function, stream, buffers)``
    (the calling convention JAX's ``as_torch_kernel`` uses, which launches on torch's default stream only). Modules
    stay loaded for the process's lifetime (nothing unloads them)."""
    import ctypes

    def load():
        try:
            import jax_plugins.xla_cuda13 as plugin
        except ImportError:
            import jax_plugins.xla_cuda12 as plugin
        return ctypes.CDLL(plugin._get_library_path()).MosaicGpuCompile

    compile_fn = _private("Mosaic GPU's runtime in JAX's CUDA plugin (MosaicGpuCompile)", load)
    compile_fn.argtypes = [ctypes.c_char_p, ctypes.c_int]
    compile_fn.restype = ctypes.POINTER(ctypes.c_void_p)
    return compile_fn


@functools.cache
def dlpack_importer() -> Callable | None:
    """``jax.dlpack.from_dlpack``'s C++ core (``dlpack_managed_tensor_to_buffer``) without its Python layers
    (~40 µs a tensor on the H100 host), or None when this JAX has none (callers use the public function)."""
    try:
        return _private("dlpack_managed_tensor_to_buffer (jax._src.lib._jax)",
                        lambda: __import__("jax._src.lib", fromlist=["_jax"])._jax.dlpack_managed_tensor_to_buffer)
    except JaxInternalsMoved:
        return None


@functools.cache
def mlir():
    """``(make_ir_context, ir, register_triton_dialect)``: JAX's MLIR context factory, its MLIR Python
    bindings and the Triton dialect registration, to read a lowered module's Triton custom calls."""

    def load():
        from jax._src.interpreters import mlir as jax_mlir
        from jax._src.lib.mlir import ir
        from jax._src.lib.triton import dialect

        return jax_mlir.make_ir_context, ir, dialect.register_dialect

    return _private("JAX's MLIR bindings (jax._src.interpreters.mlir, jax._src.lib.mlir, jax._src.lib.triton)", load)


def gpu_triton():
    """jaxlib's Triton kernel call (``jax._src.lib.gpu_triton``: ``TritonKernel``, ``TritonKernelCall``, the
    ``triton_kernel_call_ffi`` target, registered on import), the one jax-triton launches through; None when
    this jaxlib has no CUDA plugin."""

    def load():
        from jax._src.lib import gpu_triton as lib

        return lib if hasattr(lib, "TritonKernelCall") else None

    return _private("jaxlib's Triton kernel call (jax._src.lib.gpu_triton)", load)
