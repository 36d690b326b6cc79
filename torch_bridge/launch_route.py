"""The default CUDA route: JAX's own compiled kernels, launched on torch's current stream into torch's buffers.

Once per (kind, shape, dtypes, mode), the very JAX function the JAX API runs (``pallas_norm.api.forward_fn`` /
``backward_fn``, with the implementation ``impl=None`` picks on this GPU) is lowered. Pallas hands each Triton-
lowered kernel to XLA as a ``__gpu$xla.gpu.triton`` custom call whose backend config carries its grid and warps,
and each Mosaic GPU kernel as a ``mosaic_gpu_v2`` call carrying its MLIR module; our functions' modules are nothing
but a chain of such calls, read into a ``Program`` (which buffers each kernel reads and writes). XLA's compile
writes each Triton kernel's binary (``xla_binaries``); Mosaic modules are compiled by Mosaic GPU's own runtime
(the one XLA calls): the same machine code JAX launches, hence JAX's bits. Each call then allocates the results with
torch and launches those binaries through the CUDA driver (``cuda_driver``) on torch's current stream: stream
order is torch's own, nothing is copied or synchronised, the host cost is a few µs per kernel, and a CUDA graph
capture records the launches.

Besides kernel calls a module may hold splat constants (and their broadcasts) that a kernel takes as a buffer it
writes in place (an output aliased to that operand: the row-sum slots of ``pallas_norm.band_slots``, filled afresh
per call): each call fills such a buffer with ``torch.full`` on torch's current stream and hands it to the kernel as
both operand and result. A module holding anything else, a kernel cache this reader does not understand, or a
missing driver binding raises ``UnsupportedProgram``; the caller then falls back to the DLPack route (same bits,
more host time).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import re
from collections.abc import Callable

import jax
import torch

from pallas_norm import api, compat
from torch_bridge import cuda_driver, xla_binaries
from torch_bridge.jax_device import JAX_DTYPES

TRITON_TARGET = "__gpu$xla.gpu.triton"
MOSAIC_TARGET = "mosaic_gpu_v2"
_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # device -> the cudaStream_t torch uses
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

    @property
    def mosaic(self) -> bool:
        return bool(self.module)


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


def _ttir_text(ir_bytes: bytes) -> str:
    """The kernel's Triton IR (MLIR bytecode from Pallas) as text, which Triton's parser reads."""
    make_ir_context, ir, register_triton_dialect = compat.mlir()
    with make_ir_context() as ctx:
        register_triton_dialect(ctx)
        return str(ir.Module.parse(ir_bytes))


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
        if target not in (TRITON_TARGET, MOSAIC_TARGET):
            raise UnsupportedProgram(f"lowered module holds {name} {target}, not only {TRITON_TARGET} and "
                                     f"{MOSAIC_TARGET} calls")
        aliases = _aliases(op, [ids[v] for v in op.operands], fills)
        cfg = op.attributes["mhlo.backend_config"]
        results = []
        for r in op.results:
            ids[r] = len(ids)
            results.append(r)
        types = [ir.RankedTensorType(r.type) for r in results]
        if target == MOSAIC_TARGET:
            calls.append(KernelCall(
                name=f"mosaic_{len(calls)}", ttir="", grid=(1, 1, 1), num_warps=0, num_stages=0,
                operands=tuple(ids[v] for v in op.operands), results=tuple(ids[r] for r in results),
                result_shapes=tuple(tuple(t.shape) for t in types),
                result_dtypes=tuple(_TORCH_DTYPES[str(t.element_type)] for t in types),
                module=ir.StringAttr(cfg["module"]).value_bytes, aliases=aliases))
            continue
        calls.append(KernelCall(
            name=ir.StringAttr(cfg["name"]).value,
            ttir=_ttir_text(ir.StringAttr(cfg["ir"]).value_bytes),
            grid=tuple(ir.IntegerAttr(cfg[k]).value for k in ("grid_x", "grid_y", "grid_z")),
            num_warps=ir.IntegerAttr(cfg["num_warps"]).value,
            num_stages=ir.IntegerAttr(cfg["num_stages"]).value,
            operands=tuple(ids[v] for v in op.operands),
            results=tuple(ids[r] for r in results),
            result_shapes=tuple(tuple(t.shape) for t in types),
            result_dtypes=tuple(_TORCH_DTYPES[str(t.element_type)] for t in types), aliases=aliases,
        ))
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


def _specs(shapes_dtypes) -> list[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct(s, JAX_DTYPES[d]) for s, d in shapes_dtypes]


def _lower_forward(m: int, n: int, x_dtype, w_dtype, eps: float, offset: float, casting: str, config=None,
                   residual_dtype=None, h_dtype=None):
    fn = api.forward_fn(eps, offset, casting, "auto", config, None if h_dtype is None else JAX_DTYPES[h_dtype])
    specs = _specs([((m, n), x_dtype)] + ([] if residual_dtype is None else [((m, n), residual_dtype)])
                   + ([] if w_dtype is None else [((n,), w_dtype)]))
    return jax.jit(fn).trace(*specs).lower()


def _lower_backward(m: int, n: int, x_dtype, w_dtype, offset: float, casting: str, config=None, fused=False):
    fn = api.backward_fn(offset, casting, "auto", w_dtype is not None, config, fused)
    if w_dtype is None:
        fn = functools.partial(lambda f, *a: f(*a)[0], fn)
    specs = _specs([((m, n), x_dtype)] + ([] if w_dtype is None else [((n,), w_dtype)])
                   + [((m, n), x_dtype)] * (1 + fused) + [((m,), torch.float32)])
    return jax.jit(fn).trace(*specs).lower()


def forward_program(m: int, n: int, x_dtype, w_dtype, eps: float, offset: float, casting: str) -> Program:
    """The lowered forward ``(x2, *weight) -> (y, rstd)`` as a ``Program``."""
    return parse_program(_lower_forward(m, n, x_dtype, w_dtype, eps, offset, casting).compiler_ir("stablehlo"))


def backward_program(m: int, n: int, x_dtype, w_dtype, offset: float, casting: str) -> Program:
    """The lowered backward ``(x2, *weight, dy2, rstd) -> (dx, *dweight)`` as a ``Program``."""
    return parse_program(_lower_backward(m, n, x_dtype, w_dtype, offset, casting).compiler_ir("stablehlo"))


class MosaicCompileFailed(UnsupportedProgram):
    """Mosaic GPU's runtime returned no kernel for a module."""


class MosaicKernel:
    """A Mosaic GPU module compiled and loaded by Mosaic GPU's runtime (``compat.mosaic_runtime``), launched with
    its buffers in XLA's calling convention (operands, then results) on a given stream. Loaded for the process's
    lifetime, like the Triton binaries."""

    def __init__(self, module: bytes, name: str):
        torch.cuda.init()  # the runtime compiles into the current CUDA context
        handle = compat.mosaic_runtime()(ctypes.c_char_p(module), ctypes.c_int(len(module)))
        if not handle:
            raise MosaicCompileFailed(f"Mosaic GPU's runtime could not compile kernel {name}")
        self.name = name
        self._function = handle[0]
        self._launch = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p))(
            handle[1])

    def bind(self, grid, threads) -> Callable[[int, list[int]], None]:
        """``go(stream, pointers)`` (``grid``/``threads`` are the module's own: ignored). A call fills a pointer
        array whose type is made once per count."""
        function, launch, arrays = self._function, self._launch, {}

        def go(stream: int, pointers: list[int]) -> None:
            n = len(pointers)
            array = arrays.get(n) or arrays.setdefault(n, ctypes.c_void_p * n)
            launch(function, stream, array(*pointers))

        return go


def _kernel(call: KernelCall, binaries: dict[str, xla_binaries.KernelBinary], device_index: int
            ) -> cuda_driver.CudaKernel | MosaicKernel:
    """XLA's binary for ``call``, checked against the launch settings in its backend config, loaded (a Mosaic
    call: its module, compiled by Mosaic GPU's runtime)."""
    if call.mosaic:
        try:
            return MosaicKernel(call.module, call.name)
        except compat.JaxInternalsMoved as err:
            raise UnsupportedProgram(str(err)) from err
    binary = binaries.get(call.name)
    if binary is None:
        raise UnsupportedProgram(f"XLA compiled no kernel named {call.name!r} (it has {sorted(binaries)})")
    blocks = call.grid[0] * call.grid[1] * call.grid[2]
    if (binary.blocks, binary.threads, binary.cluster) != (blocks, 32 * call.num_warps, None):
        raise UnsupportedProgram(f"kernel {call.name}: XLA launches {binary.blocks} blocks of {binary.threads} "
                                 f"threads (cluster {binary.cluster}), its config says grid {call.grid} and "
                                 f"{call.num_warps} warps")
    kernel = cuda_driver.CudaKernel(binary.cubin, call.name, device_index, binary.shared_bytes)
    if len(kernel.param_sizes) < len(call.operands) + len(call.results):
        raise UnsupportedProgram(f"kernel {call.name} takes {len(kernel.param_sizes)} parameters, fewer than its "
                                 f"{len(call.operands) + len(call.results)} buffers")
    return kernel


def _allocator(program: Program, shape: tuple[int, ...], dtype: torch.dtype, out_pos: int | None,
               like: dict[int, int]) -> Callable:
    """``alloc(inputs, out)`` giving one result buffer: the caller's tensor ``out[out_pos]`` when it passes one,
    else made the cheapest way torch offers: ``empty_like`` of an input of the same size and dtype (for a program
    output, only the input the caller declared it ``like``), else ``new_empty`` in the caller's shape
    (``out[out_pos]``) when given."""
    candidates = range(program.num_inputs) if out_pos is None else [like[out_pos]] if out_pos in like else []
    source = next((i for i in candidates if (program.input_shapes[i], program.input_dtypes[i]) == (shape, dtype)),
                  None)
    if out_pos is None:
        if source is not None:
            return lambda inputs, out: torch.empty_like(inputs[source])
        return lambda inputs, out: inputs[0].new_empty(shape, dtype=dtype)

    def alloc(inputs, out):
        given = None if out is None else out[out_pos]
        if given is None:
            return torch.empty_like(inputs[source]) if source is not None else inputs[0].new_empty(shape, dtype=dtype)
        return given if isinstance(given, torch.Tensor) else inputs[0].new_empty(given, dtype=dtype)
    return alloc


class Launcher:
    """A ``Program`` with its kernels (XLA's binaries, loaded; anything with ``bind(grid, threads)``).
    ``launcher(*inputs, out=...)`` allocates every result with torch and launches each kernel on torch's current
    stream (``stream=`` overrides it; tests use that to emulate a broken bridge). Program output ``i`` is written into ``out[i]`` when that is a tensor (contiguous, on the device, of
    at least the result's size and its dtype); else it is made like input ``like[i]`` when their sizes and dtypes
    agree (it takes that input's shape), else in the shape ``out[i]`` when given (same size: the caller's shape,
    so no views), else in its program shape. Inputs only need the right sizes: kernels see data pointers, so
    callers pass N-d tensors without reshaping."""

    def __init__(self, program: Program, kernels: list[cuda_driver.CudaKernel], device_index: int,
                 like: dict[int, int] | None = None):
        self.program, self.device_index, self.kernels = program, device_index, kernels
        out_pos = {v: i for i, v in enumerate(program.outputs)}
        self._plan = tuple((kernel.bind(c.grid, 32 * c.num_warps), c.operands + c.results,
                            *self._results(c, out_pos, like or {})) for c, kernel in zip(program.calls, self.kernels))
        self._fills = program.fills
        self._outputs = program.outputs

    def _results(self, call: KernelCall, out_pos: dict[int, int], like: dict[int, int]) -> tuple[tuple, tuple]:
        """``call``'s results split once, here: ``(value, allocator)`` for those made per call and ``(value,
        operand value)`` for those that are an operand's buffer, written in place."""
        aliased = dict(call.aliases)
        made, same = [], []
        for i, (v, shape, dtype) in enumerate(zip(call.results, call.result_shapes, call.result_dtypes)):
            if i in aliased:
                same.append((v, call.operands[aliased[i]]))
            else:
                made.append((v, _allocator(self.program, shape, dtype, out_pos.get(v), like)))
        return tuple(made), tuple(same)

    def __call__(self, *inputs: torch.Tensor, out: tuple | None = None, stream: int | None = None
                 ) -> tuple[torch.Tensor, ...]:
        if stream is None:
            stream = _current_stream(self.device_index)
        values = dict(enumerate(inputs))
        for v, shape, dtype, fill in self._fills:  # on torch's current stream (``stream=`` is for tests)
            values[v] = torch.full(shape, fill, dtype=dtype, device=inputs[0].device)
        for go, buffers, made, same in self._plan:
            for v, alloc in made:
                values[v] = alloc(inputs, out)
            for v, operand in same:
                values[v] = values[operand]
            go(stream, [values[i].data_ptr() for i in buffers])
        return tuple([values[i] for i in self._outputs])


def _load(lowered, device_index: int, like: dict[int, int]) -> Launcher:
    """Compile ``lowered`` and load its kernels on ``device_index``. The device is made current again here, after
    the JAX compile: JAX's first use switches the thread's current GPU under torch's device guard, and a module
    loaded on the wrong GPU fails at launch with "invalid resource handle" (seen on rank 0 under torchrun)."""
    program = parse_program(lowered.compiler_ir("stablehlo"))
    try:
        binaries = xla_binaries.compiled_kernels(lowered) if any(not c.mosaic for c in program.calls) else {}
    except xla_binaries.CacheFormatError as err:
        raise UnsupportedProgram(str(err)) from err
    with torch.cuda.device(device_index):
        try:
            try:
                kernels = [_kernel(c, binaries, device_index) for c in program.calls]
            except MosaicCompileFailed:
                # Seen on the H100: Mosaic GPU's runtime refused the process's first module (every retry) until XLA
                # had compiled a Mosaic kernel itself; after that the same module compiles. So let XLA compile ours.
                lowered.compile()
                kernels = [_kernel(c, binaries, device_index) for c in program.calls]
            return Launcher(program, kernels, device_index, like)
        except cuda_driver.DriverUnavailable as err:
            raise UnsupportedProgram(str(err)) from err


@functools.lru_cache(maxsize=256)
def forward_launcher(m, n, x_dtype, w_dtype, eps, offset, casting, device_index: int, config=None,
                     residual_dtype=None, h_dtype=None) -> Launcher:
    """The forward ``(x, *weight) -> (y, rstd)``; ``config`` a ``pallas_config.Config`` (None: the heuristic's,
    as the JAX API runs; sweeps time others). With ``residual_dtype`` and ``h_dtype`` the fused add's forward
    ``(x, residual, *weight) -> (y, h, rstd)``."""
    with torch.cuda.device(device_index):
        lowered = _lower_forward(m, n, x_dtype, w_dtype, eps, offset, casting, config, residual_dtype, h_dtype)
    return _load(lowered, device_index, {0: 0} if h_dtype is None else {0: 1, 1: 1})  # y (and h) like x (residual)


@functools.lru_cache(maxsize=256)
def backward_launcher(m, n, x_dtype, w_dtype, offset, casting, device_index: int, config=None,
                      fused=False) -> Launcher:
    """The backward ``(x, *weight, dy, rstd) -> (dx, *dweight)``; ``config`` as for ``forward_launcher``. ``fused``:
    the fused add's backward ``(h, *weight, dy, dh_out, rstd) -> (dh, *dweight)``."""
    with torch.cuda.device(device_index):
        lowered = _lower_backward(m, n, x_dtype, w_dtype, offset, casting, config, fused)
    return _load(lowered, device_index, {0: 0} if w_dtype is None else {0: 0, 1: 1})  # dx like x, dweight like w
