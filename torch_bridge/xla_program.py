"""A lowered JAX function read as a chain of kernel launches (``Program``), for ``launch_route``.

Pallas hands each Triton-lowered kernel to XLA as a ``__gpu$xla.gpu.triton`` custom call whose backend config carries
its grid and warps, and each Mosaic GPU kernel as a ``mosaic_gpu_v2`` call carrying its MLIR module; a kernel that
``pallas_norm.triton_ffi`` launches itself is a ``triton_kernel_call_ffi`` call, read back from what that module
compiled in this process (its PTX, grid and warps); our functions' modules are nothing but a chain of such calls,
numbered here by which buffers each kernel reads and writes. Besides kernel calls a module may hold splat constants
(and their broadcasts) that a kernel takes as a buffer it writes in place (an output aliased to that operand: the
row-sum slots of ``pallas_norm.band_slots``), read as values filled per call. A module holding anything else raises
``UnsupportedProgram``.
"""

from __future__ import annotations

import dataclasses
import re

import torch

from pallas_norm import compat, triton_ffi

TRITON_TARGET = triton_ffi.XLA_TRITON_TARGET
MOSAIC_TARGET = "mosaic_gpu_v2"
FFI_TARGET = triton_ffi.FFI_TARGET
_TORCH_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32, "i32": torch.int32}
_SPLAT = re.compile(r"^dense<(-?[0-9][0-9.e+-]*|true|false)> : tensor<")


class UnsupportedProgram(RuntimeError):
    """The lowered module holds something other than kernel custom calls (e.g. XLA ops or aliasing)."""


@dataclasses.dataclass(frozen=True)
class KernelCall:
    """One kernel: a ``pallas_call`` of the Triton lowering (its IR as text, launch settings) or a Mosaic GPU
    kernel (``module``: its MLIR bytecode, which carries its own launch settings), and which values it reads and
    writes."""

    name: str
    ttir: str
    grid: tuple[int, int, int]
    num_warps: int
    num_stages: int
    operands: tuple[int, ...]
    results: tuple[int, ...]
    result_shapes: tuple[tuple[int, ...], ...]
    result_dtypes: tuple[torch.dtype, ...]
    module: bytes = b""
    aliases: tuple[tuple[int, int], ...] = ()  # (result position, operand position): the result is that buffer
    ptx: str = ""  # a kernel launched by jaxlib's Triton call: its PTX (``pallas_norm.triton_ffi``), not XLA's binary
    shared_bytes: int = 0  # and its dynamic shared memory

    @property
    def mosaic(self) -> bool:
        return bool(self.module)

    @property
    def xla_binary(self) -> bool:
        """Whether XLA compiles this kernel (neither Mosaic GPU's runtime nor, from its PTX, the driver)."""
        return not (self.module or self.ptx)


@dataclasses.dataclass(frozen=True)
class Program:
    """A straight-line chain of kernel calls over numbered values (inputs first, then, in the module's order, each
    filled constant and each call's results); ``fills``: value -> (shape, dtype, fill value), made per call."""

    calls: tuple[KernelCall, ...]
    outputs: tuple[int, ...]
    input_shapes: tuple[tuple[int, ...], ...]
    input_dtypes: tuple[torch.dtype, ...]
    fills: tuple[tuple[int, tuple[int, ...], torch.dtype, float], ...] = ()

    @property
    def num_inputs(self) -> int:
        return len(self.input_shapes)


def parse_program(module) -> Program:
    """Read a lowered StableHLO module (an MLIR ``ir.Module``) made only of kernel custom calls (Triton or Mosaic
    GPU) into a ``Program``."""
    ir = compat.mlir()[1]
    main = next(op for op in module.body.operations
                if ir.StringAttr(op.attributes["sym_name"]).value == "main")
    block = main.regions[0].blocks[0]
    ids = {arg: i for i, arg in enumerate(block.arguments)}
    calls, outputs, fills = [], (), {}
    for op in block.operations:
        name = op.operation.name
        if name == "func.return":
            outputs = tuple(ids[v] for v in op.operands)
            continue
        if name in ("stablehlo.constant", "stablehlo.broadcast_in_dim", "sdy.sharding_constraint") and _fill(
                ir, op, fills, ids):
            continue
        target = ir.StringAttr(op.attributes["call_target_name"]).value if name == "stablehlo.custom_call" else ""
        if target not in (TRITON_TARGET, MOSAIC_TARGET, FFI_TARGET):
            raise UnsupportedProgram(f"lowered module holds {name} {target}, not only {TRITON_TARGET}, "
                                     f"{MOSAIC_TARGET} and {FFI_TARGET} calls")
        aliases = _aliases(op, [ids[v] for v in op.operands], fills)
        cfg = op.attributes["mhlo.backend_config"]
        results = []
        for r in op.results:
            ids[r] = len(ids)
            results.append(r)
        types = [ir.RankedTensorType(r.type) for r in results]
        buffers = dict(operands=tuple(ids[v] for v in op.operands), results=tuple(ids[r] for r in results),
                       result_shapes=tuple(tuple(t.shape) for t in types),
                       result_dtypes=tuple(_TORCH_DTYPES[str(t.element_type)] for t in types), aliases=aliases)
        if target == FFI_TARGET:  # a Triton-lowered kernel launched by jaxlib's Triton call (pallas_norm.triton_ffi)
            kernel = triton_ffi.compiled(ir.StringAttr(cfg["opaque"]).value_bytes)
            if kernel is None:
                raise UnsupportedProgram(f"a {FFI_TARGET} call this process did not compile")
            calls.append(KernelCall(name=kernel.name, ttir="", grid=kernel.grid, num_warps=kernel.num_warps,
                                    num_stages=0, ptx=kernel.ptx, shared_bytes=kernel.shared, **buffers))
        elif target == MOSAIC_TARGET:
            calls.append(KernelCall(name=f"mosaic_{len(calls)}", ttir="", grid=(1, 1, 1), num_warps=0, num_stages=0,
                                    module=ir.StringAttr(cfg["module"]).value_bytes, **buffers))
        else:
            kernel_name, ttir, grid, warps, stages = triton_ffi.triton_call_settings(op)
            calls.append(KernelCall(name=kernel_name, ttir=ttir, grid=grid, num_warps=warps, num_stages=stages,
                                    **buffers))
    arg_types = [ir.RankedTensorType(a.type) for a in block.arguments]
    used = {v for c in calls for v in c.operands} | set(outputs)
    return Program(tuple(calls), outputs, tuple(tuple(t.shape) for t in arg_types),
                   tuple(_TORCH_DTYPES[str(t.element_type)] for t in arg_types),
                   tuple((v, *fill) for v, fill in fills.items() if v in used))


def _fill(ir, op, fills: dict, ids: dict) -> bool:
    """Number a splat constant (or a broadcast of one, or one constrained to a sharding: a no-op for one device) as a
    filled value ``fills[id] = (shape, dtype, value)``; False for anything else."""
    out = ir.RankedTensorType(op.results[0].type)
    dtype = _TORCH_DTYPES.get(str(out.element_type))
    if op.operation.name == "stablehlo.constant":
        found = _SPLAT.match(str(op.attributes["value"]))
        if found is None or dtype is None:
            return False
        text = found.group(1)
        value = 1.0 if text == "true" else 0.0 if text == "false" else float(text)
    else:
        source = ids.get(op.operands[0])
        if source not in fills or dtype is None:
            return False
        value = fills[source][2]
    ids[op.results[0]] = len(ids)
    fills[ids[op.results[0]]] = (tuple(out.shape), dtype, value)
    return True


def _aliases(op, operands: list[int], fills: dict) -> tuple[tuple[int, int], ...]:
    """A kernel call's ``output_operand_aliases`` as (result, operand) positions; only a filled constant may be
    written in place (a caller's tensor never is)."""
    if "output_operand_aliases" not in op.attributes:
        return ()
    pairs = []
    for alias in op.attributes["output_operand_aliases"]:
        found = re.search(r"output_tuple_indices = \[(\d+)\], operand_index = (\d+), operand_tuple_indices = \[\]",
                          str(alias))
        if found is None:
            raise UnsupportedProgram(f"kernel with an aliasing this reader does not know: {alias}")
        result, operand = int(found.group(1)), int(found.group(2))
        if operands[operand] not in fills:
            raise UnsupportedProgram("kernel writing into an input (input/output aliasing of a non-constant)")
        pairs.append((result, operand))
    return tuple(pairs)
