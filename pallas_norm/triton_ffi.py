"""Launching a Triton-lowered ``pallas_call`` without XLA's launch: the Triton IR Pallas hands XLA, compiled by the
``triton`` package and launched by jaxlib's own Triton custom call (``triton_kernel_call_ffi``, jax-triton's).

Why: XLA's CUDA stream executor calls ``cuFuncSetCacheConfig(CU_FUNC_CACHE_PREFER_SHARED)`` on every kernel it
launches with dynamic shared memory, and our resident kernels use 32-128 bytes of it for their cross-warp row sums:
the most shared memory, the least L1 (``bench carveout``). jaxlib's Triton call asks for that only above 48 KB, so
the same kernel keeps the driver's carveout. H100, bf16, forward from JAX, kernels timed (nineteenth session,
``bench/results/ffi_launch_h100.md``): resident 8192×32768 2.45 TB/s launched by XLA, 2.99 this way (Mosaic GPU,
``impl=None`` until now, 2.74); 32768×16384 2.92 (XLA, 32 warps) → 2.99-3.04 (16 warps); 4096×16384 2.83 →
2.89-2.92.

Bits: the PTX's floating-point ``mul``/``add``/``sub`` without a rounding modifier may be contracted into FMAs by
whichever assembler builds the binary (jaxlib's ptxas here, the driver's JIT in the torch launch route), so
:func:`pin_rounding` gives them ``.rn``: the same arithmetic from any assembler, JAX's bits in both stacks.

Used where ``pallas_config`` says (``Config.ffi_launch``) and :func:`available` (an NVIDIA GPU of compute
capability 9.0 or more, the ``triton`` package, jaxlib's CUDA plugin; ``PALLAS_NORM_TRITON_FFI=0`` turns it off).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import tempfile
import zlib

import jax

from . import backend, compat

ENV = "PALLAS_NORM_TRITON_FFI"
FFI_TARGET = "triton_kernel_call_ffi"
XLA_TRITON_TARGET = "__gpu$xla.gpu.triton"
MIN_CC = 90  # measured on Hopper only
_UNROUNDED = re.compile(r"\b(mul|add|sub)((?:\.ftz)?(?:\.sat)?)\.(f16|f16x2|bf16|bf16x2|f32|f64)\b")


@dataclasses.dataclass(frozen=True)
class Compiled:
    """One kernel as launched: its entry ``name``, ``ptx`` (rounding pinned), dynamic ``shared`` bytes, warps,
    grid and the custom call's ``opaque`` payload (which the torch launch route looks it up by)."""

    name: str
    ptx: str
    shared: int
    num_warps: int
    grid: tuple[int, int, int]
    opaque: bytes


_BY_OPAQUE: dict[bytes, Compiled] = {}


@functools.cache
def available() -> bool:
    """Whether kernels can be launched this way here (see the module docstring)."""
    if os.environ.get(ENV, "1") == "0" or not backend.on_gpu() or backend.compute_capability() < MIN_CC:
        return False
    try:
        import triton  # noqa: F401
        from triton.backends.compiler import GPUTarget  # noqa: F401

        return compat.gpu_triton() is not None
    except (ImportError, compat.JaxInternalsMoved):
        return False


def pin_rounding(ptx: str) -> str:
    """``ptx`` with every floating-point ``mul``/``add``/``sub`` that has no rounding modifier given ``.rn`` (its
    default rounding, but no longer contractible into an FMA by the assembler)."""
    return _UNROUNDED.sub(r"\1.rn\2.\3", ptx)


def contractible_ops(ptx: str) -> int:
    """How many floating-point ``mul``/``add``/``sub`` of ``ptx`` have no rounding modifier (the assembler may fuse
    them into FMAs; 0 after :func:`pin_rounding`)."""
    return len(_UNROUNDED.findall(ptx))


def ttir_text(ir_bytes: bytes) -> str:
    """A kernel's Triton IR (MLIR bytecode from Pallas) as text, which Triton's parser reads."""
    make_ir_context, ir, register_triton_dialect = compat.mlir()
    with make_ir_context() as ctx:
        register_triton_dialect(ctx)
        return str(ir.Module.parse(ir_bytes))


def triton_call_settings(op) -> tuple[str, str, tuple[int, int, int], int, int]:
    """``(name, ttir, grid, num_warps, num_stages)`` of a ``__gpu$xla.gpu.triton`` custom call (its backend config;
    the torch launch route reads its programs' calls with it too)."""
    ir = compat.mlir()[1]
    cfg = op.attributes["mhlo.backend_config"]
    value = lambda key: ir.IntegerAttr(cfg[key]).value  # noqa: E731
    return (ir.StringAttr(cfg["name"]).value, ttir_text(ir.StringAttr(cfg["ir"]).value_bytes),
            (value("grid_x"), value("grid_y"), value("grid_z")), value("num_warps"), value("num_stages"))


def _kernel_of(module) -> tuple[str, str, tuple[int, int, int], int, int]:
    """``triton_call_settings`` of the one Triton custom call of a lowered ``pallas_call``."""
    ir = compat.mlir()[1]
    main = next(op for op in module.body.operations if ir.StringAttr(op.attributes["sym_name"]).value == "main")
    calls = [op for op in main.regions[0].blocks[0].operations if op.operation.name == "stablehlo.custom_call"
             and ir.StringAttr(op.attributes["call_target_name"]).value == XLA_TRITON_TARGET]
    if len(calls) != 1:
        raise ValueError(f"expected one {XLA_TRITON_TARGET} call in the lowered pallas_call, found {len(calls)}")
    return triton_call_settings(calls[0])


def triton_binary(ttir: str, cc: int, num_warps: int, num_stages: int, maxnreg: int | None = None):
    """``ttir`` compiled by the ``triton`` package for compute capability ``cc`` (``maxnreg``: PTX ``.maxnreg``):
    the compiled kernel, its ``asm["ptx"]`` unpinned and its ``metadata``."""
    import triton
    from triton.backends.compiler import GPUTarget

    with tempfile.NamedTemporaryFile("w", suffix=".ttir") as f:
        f.write(ttir)
        f.flush()
        return triton.compile(f.name, target=GPUTarget("cuda", cc, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages, maxnreg=maxnreg))


@functools.lru_cache(maxsize=None)
def _compile(name: str, ttir: str, grid: tuple[int, int, int], num_warps: int, num_stages: int, cc: int,
             operands: int, maxnreg: int | None = None) -> Compiled:
    binary = triton_binary(ttir, cc, num_warps, num_stages, maxnreg)
    md = binary.metadata
    if getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0):
        raise ValueError(f"kernel {name} needs a global scratch buffer, which this launch does not provide")
    ptx = pin_rounding(binary.asm["ptx"])
    lib = compat.gpu_triton()
    kernel = lib.TritonKernel(md.name, num_warps, 1, md.shared, ptx, "", cc)
    call = lib.TritonKernelCall(kernel, *grid, [lib.create_array_parameter(0, 16) for _ in range(operands)])
    opaque = zlib.compress(call.to_proto(md.name, b""))
    compiled = Compiled(md.name, ptx, md.shared, num_warps, grid, opaque)
    _BY_OPAQUE[opaque] = compiled
    return compiled


def compiled(opaque: bytes) -> Compiled | None:
    """The kernel behind a ``triton_kernel_call_ffi`` call's ``opaque`` payload, if this process compiled it."""
    return _BY_OPAQUE.get(opaque)


def launch(pallas_fn, args, out_shape, *, maxnreg: int | None = None):
    """``pallas_fn(*args)`` (a Triton-lowered ``pallas_call`` returning ``out_shape``), launched by jaxlib's Triton
    call instead of XLA (see the module docstring); ``pallas_fn`` is lowered on its own to read its Triton IR.
    ``maxnreg``: the most registers per thread the assembler may give it (PTX ``.maxnreg``; None: no limit), so that
    a persistent grid's programs fit on their SMs at once (``pallas_config.register_cap``)."""
    if not available():
        raise RuntimeError(f"ffi_launch needs an NVIDIA GPU of compute capability >= {MIN_CC / 10}, the triton "
                           f"package and jaxlib's CUDA plugin (and {ENV} not 0); use a Config without ffi_launch")
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    module = jax.jit(pallas_fn).trace(*specs).lower().compiler_ir("stablehlo")
    out = jax.tree.leaves(out_shape)
    kernel = _compile(*_kernel_of(module), backend.compute_capability(), len(args) + len(out), maxnreg)
    return jax.ffi.ffi_call(FFI_TARGET, tuple(out))(*args, opaque=kernel.opaque)
