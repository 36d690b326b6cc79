"""The default CUDA route: JAX's own compiled kernels, launched on torch's current stream into torch's buffers.

Once per (kind, shape, dtypes, mode), the very JAX function the JAX API runs (``pallas_norm.api.forward_fn`` /
``backward_fn``, with the implementation ``impl=None`` picks on this GPU) is lowered and read into a ``Program``
(``xla_program``: a chain of Triton-lowered and Mosaic GPU kernel calls over numbered buffers). XLA's compile
writes each Triton kernel's binary (``xla_binaries``); Mosaic modules are compiled by Mosaic GPU's own runtime
(the one XLA calls): the same machine code JAX launches, hence JAX's bits. Each call then allocates the results with
torch and launches those binaries through the CUDA driver (``cuda_driver``) on torch's current stream: stream
order is torch's own, nothing is copied or synchronised, the host cost is a few µs per kernel, and a CUDA graph
capture records the launches.

A buffer the module fills with a constant (the band kernels' row-sum slots) is filled per call with ``torch.full``
on torch's current stream and handed to the kernel as both operand and result. A module holding anything else, a
kernel cache this reader does not understand, or a missing driver binding raises ``UnsupportedProgram``; the caller
then falls back to the DLPack route (same bits, more host time).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import jax
import torch

from pallas_norm import api, compat
from torch_bridge import cuda_driver, xla_binaries
from torch_bridge.jax_device import JAX_DTYPES
from torch_bridge.xla_program import KernelCall, Program, UnsupportedProgram, parse_program

__all__ = ["KernelCall", "Launcher", "Program", "UnsupportedProgram", "backward_launcher", "backward_program",
           "forward_launcher", "forward_program", "parse_program"]

_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # device -> the cudaStream_t torch uses


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
    call: its module, compiled by Mosaic GPU's runtime; a kernel JAX launches through jaxlib's Triton call: its PTX,
    assembled by the driver)."""
    if call.mosaic:
        try:
            return MosaicKernel(call.module, call.name)
        except compat.JaxInternalsMoved as err:
            raise UnsupportedProgram(str(err)) from err
    if call.ptx:  # launched by jaxlib's Triton call from JAX: the same PTX, assembled by the driver
        return cuda_driver.CudaKernel(call.ptx.encode() + b"\0", call.name, device_index, call.shared_bytes)
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
        binaries = xla_binaries.compiled_kernels(lowered) if any(c.xla_binary for c in program.calls) else {}
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
