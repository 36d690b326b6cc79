"""The fast CUDA route: run the Pallas kernels on torch's current stream, without the JAX runtime per call.

Once per (kind, shape, dtypes, mode), ``forward_program``/``backward_program`` lower the very JAX function the JAX API runs
(``pallas_norm.api.forward_fn`` / ``backward_fn``) and reads the lowered module. Pallas hands each kernel to
XLA as a ``__gpu$xla.gpu.triton`` custom call whose backend config carries the kernel's Triton IR, grid and
launch settings. The module of our functions is nothing but a chain of such calls, so it is kept as a
``Program``: each kernel's IR is compiled by Triton (the one torch ships) and launched with torch-allocated
buffers on torch's current stream. Stream order is therefore torch's own, and nothing is copied.

A module holding anything else raises ``UnsupportedProgram`` and the caller falls back to the DLPack route.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import tempfile

import jax
import torch

from pallas_norm import api, compat

TRITON_TARGET = "__gpu$xla.gpu.triton"
_TORCH_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
_JAX_DTYPES = {torch.float16: jax.numpy.float16, torch.bfloat16: jax.numpy.bfloat16,
               torch.float32: jax.numpy.float32}


class UnsupportedProgram(RuntimeError):
    """The lowered module holds something other than Triton custom calls (e.g. XLA ops or aliasing)."""


@dataclasses.dataclass(frozen=True)
class KernelCall:
    """One ``pallas_call``: its Triton IR (text), launch settings, and which values it reads and writes."""

    name: str
    ttir: str
    grid: tuple[int, int, int]
    num_warps: int
    num_stages: int
    operands: tuple[int, ...]
    results: tuple[int, ...]
    result_shapes: tuple[tuple[int, ...], ...]
    result_dtypes: tuple[torch.dtype, ...]


@dataclasses.dataclass(frozen=True)
class Program:
    """A straight-line chain of kernel calls over numbered values (inputs first, then each call's results)."""

    num_inputs: int
    calls: tuple[KernelCall, ...]
    outputs: tuple[int, ...]


def _ttir_text(ir_bytes: bytes) -> str:
    """The kernel's Triton IR (MLIR bytecode from Pallas) as text, which Triton's parser reads."""
    make_ir_context, ir, register_triton_dialect = compat.mlir()
    with make_ir_context() as ctx:
        register_triton_dialect(ctx)
        return str(ir.Module.parse(ir_bytes))


def parse_program(module) -> Program:
    """Read a lowered StableHLO module (an MLIR ``ir.Module``) made only of Triton custom calls into a
    ``Program``."""
    ir = compat.mlir()[1]
    main = next(op for op in module.body.operations
                if ir.StringAttr(op.attributes["sym_name"]).value == "main")
    block = main.regions[0].blocks[0]
    ids = {arg: i for i, arg in enumerate(block.arguments)}
    calls, outputs = [], ()
    for op in block.operations:
        name = op.operation.name
        if name == "func.return":
            outputs = tuple(ids[v] for v in op.operands)
            continue
        if name != "stablehlo.custom_call" or ir.StringAttr(op.attributes["call_target_name"]).value != TRITON_TARGET:
            raise UnsupportedProgram(f"lowered module holds {name}, not only {TRITON_TARGET} calls")
        if "output_operand_aliases" in op.attributes and len(op.attributes["output_operand_aliases"]):
            raise UnsupportedProgram("kernel with input/output aliasing")
        cfg = op.attributes["mhlo.backend_config"]
        results = []
        for r in op.results:
            ids[r] = len(ids)
            results.append(r)
        types = [ir.RankedTensorType(r.type) for r in results]
        calls.append(KernelCall(
            name=ir.StringAttr(cfg["name"]).value,
            ttir=_ttir_text(ir.StringAttr(cfg["ir"]).value_bytes),
            grid=tuple(ir.IntegerAttr(cfg[k]).value for k in ("grid_x", "grid_y", "grid_z")),
            num_warps=ir.IntegerAttr(cfg["num_warps"]).value,
            num_stages=ir.IntegerAttr(cfg["num_stages"]).value,
            operands=tuple(ids[v] for v in op.operands),
            results=tuple(ids[r] for r in results),
            result_shapes=tuple(tuple(t.shape) for t in types),
            result_dtypes=tuple(_TORCH_DTYPES[str(t.element_type)] for t in types),
        ))
    return Program(len(block.arguments), tuple(calls), outputs)


def _specs(shapes_dtypes) -> list[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct(s, _JAX_DTYPES[d]) for s, d in shapes_dtypes]


def forward_program(m: int, n: int, x_dtype, w_dtype, eps: float, offset: float, casting: str) -> Program:
    """The lowered forward ``(x2, *weight) -> (y, rstd)`` as a ``Program``."""
    fn = api.forward_fn(eps, offset, casting, "pallas")
    specs = _specs([((m, n), x_dtype)] + ([] if w_dtype is None else [((n,), w_dtype)]))
    return parse_program(jax.jit(fn).trace(*specs).lower().compiler_ir("stablehlo"))


def backward_program(m: int, n: int, x_dtype, w_dtype, offset: float, casting: str) -> Program:
    """The lowered backward ``(x2, *weight, dy2, rstd) -> (dx, *dweight)`` as a ``Program``."""
    fn = api.backward_fn(offset, casting, "pallas", w_dtype is not None)
    if w_dtype is None:
        fn = functools.partial(lambda f, *a: f(*a)[0], fn)
    specs = _specs([((m, n), x_dtype)] + ([] if w_dtype is None else [((n,), w_dtype)])
                   + [((m, n), x_dtype), ((m,), torch.float32)])
    return parse_program(jax.jit(fn).trace(*specs).lower().compiler_ir("stablehlo"))


def _compile(call: KernelCall):
    """Compile one kernel's Triton IR with torch's Triton for the current GPU (Triton caches on disk) and load it."""
    import triton
    from triton.runtime import driver

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{call.name}.ttir")
        with open(path, "w") as f:
            f.write(call.ttir)
        kernel = triton.compile(path, target=driver.active.get_current_target(),
                                options={"num_warps": call.num_warps, "num_stages": call.num_stages})
    kernel[call.grid]  # loads the module on the current device
    return kernel


def _direct_launch(kernel, grid):
    """``launch(stream, *tensors)`` through the C launcher Triton built for this kernel, skipping the Python
    layers of ``kernel[grid](...)`` (several µs a call); None when the kernel needs scratch memory or launch
    hooks are set, which only those layers handle."""
    from triton import knobs

    run = kernel.run
    if (run.global_scratch_size or run.profile_scratch_size or knobs.runtime.launch_enter_hook
            or knobs.runtime.launch_exit_hook):
        return None
    launch, function, meta = run.launch, kernel.function, kernel.packed_metadata
    coop, pdl = run.launch_cooperative_grid, run.launch_pdl
    gx, gy, gz = grid

    def go(stream, *args):
        launch(gx, gy, gz, stream, function, coop, pdl, None, None, meta, None, None, None, *args)

    return go


class Launcher:
    """A compiled ``Program``. ``launcher(*inputs, out_shapes=...)`` allocates every result with torch (program
    outputs in ``out_shapes`` when given: same sizes, the caller's shapes, so no views) and launches each kernel
    on torch's current stream (``stream=`` overrides it; tests use that to emulate a broken bridge). Inputs
    only need the right sizes: kernels see data pointers, so callers pass N-d tensors without reshaping."""

    def __init__(self, program: Program, device_index: int):
        self.program, self.device_index = program, device_index
        self.device = torch.device("cuda", device_index)
        kernels = [_compile(c) for c in program.calls]
        self.launches = []
        for call, kernel in zip(program.calls, kernels):
            go = _direct_launch(kernel, call.grid)
            if go is None:
                runner = kernel[call.grid]
                go = lambda stream, *args, runner=runner: runner(*args, stream=stream)  # noqa: E731
            self.launches.append(go)
        out_pos = {v: i for i, v in enumerate(program.outputs)}
        self.allocs = [tuple((out_pos.get(v), shape, dtype) for v, shape, dtype in
                             zip(c.results, c.result_shapes, c.result_dtypes)) for c in program.calls]

    def __call__(self, *inputs: torch.Tensor, out_shapes=None, stream: int | None = None
                 ) -> tuple[torch.Tensor, ...]:
        if stream is None:
            stream = torch._C._cuda_getCurrentRawStream(self.device_index)
        values = list(inputs)
        for call, go, allocs in zip(self.program.calls, self.launches, self.allocs):
            outs = [torch.empty(shape if pos is None or out_shapes is None else out_shapes[pos], dtype=dtype,
                                device=self.device) for pos, shape, dtype in allocs]
            go(stream, *[values[i] for i in call.operands], *outs)
            values.extend(outs)
        return tuple(values[i] for i in self.program.outputs)


def _load(program: Program, device_index: int) -> Launcher:
    """Load ``program`` on ``device_index``. The device is made current again here, after the JAX lowering that
    built ``program``: JAX's first use switches the thread's current GPU under torch's device guard, and a module
    loaded on the wrong GPU fails at launch with "invalid resource handle" (seen on rank 0 under torchrun)."""
    with torch.cuda.device(device_index):
        return Launcher(program, device_index)


@functools.lru_cache(maxsize=256)
def forward_launcher(m, n, x_dtype, w_dtype, eps, offset, casting, device_index: int) -> Launcher:
    with torch.cuda.device(device_index):
        program = forward_program(m, n, x_dtype, w_dtype, eps, offset, casting)
    return _load(program, device_index)


@functools.lru_cache(maxsize=256)
def backward_launcher(m, n, x_dtype, w_dtype, offset, casting, device_index: int) -> Launcher:
    with torch.cuda.device(device_index):
        program = backward_program(m, n, x_dtype, w_dtype, offset, casting)
    return _load(program, device_index)
