"""The torch launch route's machinery without a GPU: the reader of lowered modules (kernels, grids, data flow), the
reader of XLA's kernel cache, bound launches' parameter slots and the launch plan (``torch_bridge.launch_route``,
``xla_binaries``, ``cuda_driver``), the driver faked. The route's bits and speed on a GPU: ``test_bridge.py``,
``test_bridge_gpu.py``.
"""

from __future__ import annotations

import ctypes
import os
import threading

import jax
import jax.numpy as jnp
import pytest
import torch

from pallas_norm import pallas_config
from torch_bridge import cuda_driver, launch_route, xla_binaries

from helpers import abstract_h100


def test_launch_route_reads_lowered_modules_as_kernel_chains():
    """The launch route's reader, on modules lowered for an (abstract) H100: kernels, grids, data flow; and a
    module with an XLA op is refused (the caller then falls back to DLPack)."""
    with abstract_h100():
        fwd = launch_route.forward_program(8, 4096, torch.bfloat16, torch.bfloat16, 1e-6, 0.0, "llama")
        chunked = pallas_config.Config(block_rows=1, block_cols=4096, num_warps=16)  # 3 kernels (the heuristic: bands)
        bwd = launch_route.parse_program(launch_route._lower_backward(
            8, 32768, torch.bfloat16, torch.float32, 1.0, "gemma", chunked).compiler_ir("stablehlo"))
        xla = jax.jit(lambda a: a * 2).trace(jax.ShapeDtypeStruct((4,), jnp.float32)).lower()
    assert [c.name for c in fwd.calls] == ["pallas_norm_fwd"] and fwd.num_inputs == 2 and fwd.outputs == (2, 3)
    assert (fwd.input_shapes, fwd.input_dtypes) == (((8, 4096), (4096,)), (torch.bfloat16, torch.bfloat16))
    assert fwd.calls[0].result_shapes == ((8, 4096), (8,)) and "tt.func public @pallas_norm_fwd" in fwd.calls[0].ttir
    names = [c.name for c in bwd.calls]
    assert names == ["pallas_norm_bwd_rowsum", "pallas_norm_bwd_chunks", "pallas_norm_dweight_reduce"]
    rowsum, chunks, reduce = bwd.calls
    assert chunks.operands[-1] == rowsum.results[0] and reduce.operands == (chunks.results[1],)
    assert bwd.outputs == (chunks.results[0], reduce.results[0])
    with pytest.raises(launch_route.UnsupportedProgram, match="not only __gpu"):
        launch_route.parse_program(xla.compiler_ir("stablehlo"))


def _field(number: int, value: int | bytes) -> bytes:
    """One protocol-buffer field (varint or length-delimited), to build kernel caches by hand."""
    def varint(v: int) -> bytes:
        out = bytearray()
        while True:
            out.append((v & 0x7F) | (0x80 if v > 0x7F else 0))
            v >>= 7
            if not v:
                return bytes(out)
    if isinstance(value, int):
        return varint(number << 3) + varint(value)
    return varint(number << 3 | 2) + varint(len(value)) + value


def _cache(name: bytes, binary: bytes, launch: bytes, *extra: bytes) -> bytes:
    entry = _field(2, launch) + b"".join(extra) + _field(4, 512) + _field(5, binary)
    return _field(1, _field(1, name) + _field(2, entry))


def test_kernel_cache_reader_on_a_file_xla_wrote():
    """``tests/data/xla_kernel_cache_h100.pb``: what XLA (jax 0.11.2, H100) wrote for the 8×4096 bf16 forward (and
    the broadcasts of ``jnp.ones``): our kernel by its ``pallas_call`` name, 4 blocks of 256 threads, 64 bytes of
    shared memory, an sm_90a cubin."""
    with open(os.path.join(os.path.dirname(__file__), "data", "xla_kernel_cache_h100.pb"), "rb") as f:
        kernels = xla_binaries.parse_kernel_cache(f.read())
    fwd = kernels["pallas_norm_fwd"]
    assert (fwd.blocks, fwd.threads, fwd.shared_bytes, fwd.cluster) == (4, 256, 64, None)
    assert fwd.cubin.startswith(b"\x7fELF") and b"pallas_norm_fwd" in fwd.cubin
    assert {"wrapped_broadcast", "wrapped_dynamic_slice"} <= set(kernels)


def test_kernel_cache_reader_dimensions_and_refusals():
    elf = b"\x7fELF" + bytes(60)
    dims = xla_binaries.parse_kernel_cache(_cache(b"k", elf, _field(1, 6) + _field(2, 128)))["k"]
    assert (dims.blocks, dims.threads, dims.shared_bytes, dims.cluster) == (6, 128, 512, None)
    three_d = _field(1, _field(1, 2) + _field(2, 3)) + _field(2, _field(1, 64))  # {x, y, z} messages
    cluster = _field(3, _field(1, 2) + _field(2, 1) + _field(3, 1))
    dims = xla_binaries.parse_kernel_cache(_cache(b"k", elf, three_d, cluster))["k"]
    assert (dims.blocks, dims.threads, dims.cluster) == (6, 64, (2, 1, 1))
    with pytest.raises(xla_binaries.CacheFormatError, match="not an ELF cubin"):
        xla_binaries.parse_kernel_cache(_cache(b"k", b"PTX text", _field(1, 1)))
    with pytest.raises(xla_binaries.CacheFormatError):
        xla_binaries.parse_kernel_cache(_cache(b"k", elf, _field(1, 1))[:-3])  # truncated


class _FakeDriver:
    """Stands in for libcuda: records each launch's arguments as the kernel's parameter slots hold them."""

    def __init__(self, slots):
        self.slots, self.launches, self.error, self.current = slots, [], 0, 5

    def cuLaunchKernel(self, function, gx, gy, gz, bx, by, bz, shared, stream, argv, extra):
        self.launches.append(((gx, gy, gz), bx, shared, stream, list(self.slots)))
        return self.error or (cuda_driver._INVALID_CONTEXT if self.current is None else 0)

    def cuCtxSetCurrent(self, context):
        self.current = context.value
        return 0

    def cuGetErrorName(self, error, name):
        return 0


def _fake_kernel(params: int = 6) -> cuda_driver.CudaKernel:
    kernel = cuda_driver.CudaKernel.__new__(cuda_driver.CudaKernel)  # no GPU: the driver is faked
    kernel.name, kernel.function, kernel.shared_bytes, kernel.param_sizes = "k", 1, 64, (8,) * params
    kernel.context = 5
    kernel._values = (ctypes.c_uint64 * params)()
    kernel._argv_address, kernel._lock, kernel._filled = 0, threading.Lock(), 0
    kernel._lib = _FakeDriver(kernel._values)
    return kernel


def test_bound_launches_fill_parameter_slots_and_null_the_rest():
    """Pointers fill the first slots; slots past them are null even after a launch with more pointers (a stale
    pointer there would reach the kernel's scratch parameters); too many pointers or a driver error raise."""
    kernel = _fake_kernel()
    go = kernel.bind((4, 2, 1), 256)
    go(7, [11, 12, 13, 14, 15])
    kernel.launch((1, 1, 1), 32, 8, [21, 22])
    go(7, [31, 32, 33, 34])
    launches = kernel._lib.launches
    assert launches[0] == ((4, 2, 1), 256, 64, 7, [11, 12, 13, 14, 15, 0])
    assert launches[1] == ((1, 1, 1), 32, 64, 8, [21, 22, 0, 0, 0, 0])
    assert launches[2][-1] == [31, 32, 33, 34, 0, 0]
    with pytest.raises(ValueError, match="takes 6 parameters, got 7"):
        go(7, list(range(7)))
    kernel._lib.error = 700
    with pytest.raises(cuda_driver.DriverUnavailable, match="launching k failed: CUresult 700"):
        go(7, [1])
    kernel._lib.error, kernel._lib.current = 0, None  # a thread without a current context: made current, retried
    go(7, [2])
    assert kernel._lib.current == 5 and [launch[-1][0] for launch in launches[-2:]] == [2, 2]
    forgetful = _fake_kernel()  # a broken variant that forgets the longer launch: the check above sees its stale slot
    forgetful.launch((1, 1, 1), 32, 8, [1, 2, 3])
    forgetful._filled = 0
    forgetful.launch((1, 1, 1), 32, 8, [4])
    assert forgetful._lib.launches[-1][-1] != [4, 0, 0, 0, 0, 0]


def test_launcher_allocates_like_inputs_into_given_buffers_and_chains_kernels():
    """The launch plan on CPU tensors with faked kernels: y is made like x (x's N-d shape), rstd in the shape the
    caller gives or into the tensor it gives, an intermediate feeds the next kernel, and each kernel gets its
    buffers' pointers in order."""
    bf16, f32 = torch.bfloat16, torch.float32
    first = launch_route.KernelCall("a", "", (2, 1, 1), 4, 1, (0, 1), (2, 3, 4), ((6, 8), (6,), (6, 8)),
                                    (bf16, f32, f32))
    second = launch_route.KernelCall("b", "", (1, 1, 1), 1, 1, (4,), (5,), ((8,),), (bf16,))
    program = launch_route.Program((first, second), (2, 3, 5), ((6, 8), (8,)), (bf16, bf16))
    kernels = [_fake_kernel(), _fake_kernel()]
    launcher = launch_route.Launcher(program, kernels, 0, like={0: 0, 2: 1})
    x, w = torch.ones(2, 3, 8, dtype=bf16), torch.ones(8, dtype=bf16)
    y, rstd, dw = launcher(x, w, out=(None, (2, 3), None), stream=5)
    assert (y.shape, y.dtype, rstd.shape, rstd.dtype, dw.shape, dw.dtype) == ((2, 3, 8), bf16, (2, 3), f32, (8,), bf16)
    (_, threads, _, stream, slots), = kernels[0]._lib.launches
    assert (threads, stream) == (128, 5) and slots[:4] == [x.data_ptr(), w.data_ptr(), y.data_ptr(), rstd.data_ptr()]
    partials = slots[4]
    assert kernels[1]._lib.launches[0][-1][:2] == [partials, dw.data_ptr()]
    scratch = torch.empty(16, dtype=f32)
    y2, rstd2, _ = launcher(x, w, out=(None, scratch, None), stream=5)
    assert rstd2 is scratch and y2.shape == x.shape
    assert launcher(x.view(6, 8), w, stream=5)[1].shape == (6,)  # no shapes given: program shapes


@pytest.mark.parametrize("variant", ["launcher", "broken"])
def test_launcher_fills_constants_per_call_and_writes_aliased_results_in_place(monkeypatch, variant):
    """A filled constant (the bands' slots) is made per call with its fill value and handed to the kernel as both an
    operand and the result aliased to it: one buffer, the same pointer twice. The broken variant allocates the
    aliased result apart (the kernel would post into a buffer nobody reads) and is caught."""
    i32 = torch.int32
    call = launch_route.KernelCall("k", "", (1, 1, 1), 1, 1, (0, 1), (2, 3), ((6, 8), (6, 4)), (torch.bfloat16, i32),
                                   aliases=((1, 1),))
    program = launch_route.Program((call,), (2, 3), ((6, 8),), (torch.bfloat16,), fills=((1, (6, 4), i32, -1.0),))
    if variant == "broken":
        monkeypatch.setattr(launch_route.Launcher, "_results", lambda self, c, out_pos, like: (tuple(
            (v, launch_route._allocator(self.program, shape, dtype, out_pos.get(v), like))
            for v, shape, dtype in zip(c.results, c.result_shapes, c.result_dtypes)), ()))
    kernel = _fake_kernel()
    launcher = launch_route.Launcher(program, [kernel], 0)
    x = torch.ones(6, 8, dtype=torch.bfloat16)
    _, first = launcher(x, stream=3)
    first.fill_(5)  # what the kernel posted: the next call must start from the fill again
    y, slots = launcher(x, stream=3)
    pointers = kernel._lib.launches[-1][-1]

    def check():
        assert pointers[:3] == [x.data_ptr(), slots.data_ptr(), y.data_ptr()] and pointers[3] == pointers[1]
        assert torch.equal(slots, torch.full((6, 4), -1, dtype=i32))

    if variant == "broken":
        with pytest.raises(AssertionError):
            check()
    else:
        check()
