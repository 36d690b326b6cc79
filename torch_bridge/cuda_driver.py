"""Load a cubin and launch its kernel on a torch stream, through the CUDA driver API (``libcuda``, via ctypes).

``CudaKernel(cubin, name, device_index, shared_bytes)`` loads the binary into the device's primary context (the
one torch uses) and reads the kernel's parameter layout and resources (``registers`` per thread, ``local_bytes``
of spill stack per thread: what a sweep reports). ``kernel.launch(grid, threads, stream, pointers)``
launches it with device pointers as its arguments; parameters past the pointers given (Triton's scratch
pointers, which our kernels never use) are passed as null. A launch is one driver call, so it is recorded when
the stream is being captured into a CUDA graph. It runs in the calling thread's current context; a thread left
without one (``CUDA_ERROR_INVALID_CONTEXT``: building a backward launcher right before its first launch did that)
gets the primary context made current and the launch retried.

The driver is called through ctypes rather than the ``cuda-bindings`` package: the few entry points used here
have had stable C signatures since CUDA 12.4, the driver library is loaded in every process that runs torch on
CUDA, and a ctypes call is the cheaper of the two per launch (the H100 host measured 8.8 µs per launch through
``cuda.bindings.driver.cuLaunchKernel``).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable, Sequence

_STATIC_SHARED_LIMIT = 48 * 1024  # above this a kernel must opt in to dynamic shared memory
_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
_LOCAL_SIZE_BYTES, _NUM_REGS = 3, 4  # CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, CU_FUNC_ATTRIBUTE_NUM_REGS
_CARVEOUT = 9  # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
_INVALID_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT: the calling thread has no current context
_P, _I, _U, _S = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_size_t
_SIGNATURES = {
    "cuInit": (_U,),
    "cuDeviceGet": (ctypes.POINTER(_I), _I),
    "cuDevicePrimaryCtxRetain": (ctypes.POINTER(_P), _I),
    "cuCtxPushCurrent_v2": (_P,),
    "cuCtxPopCurrent_v2": (ctypes.POINTER(_P),),
    "cuCtxSetCurrent": (_P,),
    "cuModuleLoadData": (ctypes.POINTER(_P), ctypes.c_char_p),
    "cuModuleGetFunction": (ctypes.POINTER(_P), _P, ctypes.c_char_p),
    "cuFuncSetAttribute": (_P, _I, _I),
    "cuFuncGetAttribute": (ctypes.POINTER(_I), _I, _P),
    "cuFuncGetParamInfo": (_P, _S, ctypes.POINTER(_S), ctypes.POINTER(_S)),
    "cuLaunchKernel": (_P, _U, _U, _U, _U, _U, _U, _U, _P, _P, _P),
    "cuGetErrorName": (_I, ctypes.POINTER(ctypes.c_char_p)),
}


class DriverUnavailable(RuntimeError):
    """The CUDA driver library cannot be loaded, lacks an entry point, or refused a call."""


@functools.cache
def _libcuda() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, _I
    except (OSError, AttributeError) as err:
        raise DriverUnavailable(f"the CUDA driver library (libcuda.so.1, CUDA >= 12.4) is not usable: {err}") from err
    return lib


def _check(lib: ctypes.CDLL, err: int, what: str) -> None:
    if err:
        name = ctypes.c_char_p()
        lib.cuGetErrorName(err, ctypes.byref(name))
        raise DriverUnavailable(f"{what} failed: {(name.value or b'CUresult %d' % err).decode()}")


class CudaKernel:
    """One kernel of a cubin, loaded on ``device_index``."""

    def __init__(self, cubin: bytes, name: str, device_index: int, shared_bytes: int):
        lib = self._lib = _libcuda()
        device, context = _I(), _P()
        _check(lib, lib.cuInit(0), "cuInit")
        _check(lib, lib.cuDeviceGet(ctypes.byref(device), device_index), "cuDeviceGet")
        _check(lib, lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain")
        _check(lib, lib.cuCtxPushCurrent_v2(context), "cuCtxPushCurrent")
        module, function = _P(), _P()
        try:
            _check(lib, lib.cuModuleLoadData(ctypes.byref(module), cubin), f"loading the cubin of {name}")
            _check(lib, lib.cuModuleGetFunction(ctypes.byref(function), module, name.encode()),
                   f"finding kernel {name}")
            if shared_bytes > _STATIC_SHARED_LIMIT:
                _check(lib, lib.cuFuncSetAttribute(function, _MAX_DYNAMIC_SHARED_SIZE_BYTES, shared_bytes),
                       "cuFuncSetAttribute")
            self.param_sizes = self._param_sizes(function)
            self.registers, self.local_bytes = (self._attribute(function, a) for a in (_NUM_REGS, _LOCAL_SIZE_BYTES))
        finally:
            lib.cuCtxPopCurrent_v2(ctypes.byref(_P()))
        self.name, self.shared_bytes, self.module, self.function = name, shared_bytes, module, function.value
        self.context = context.value  # the device's primary context, torch's
        if any(size != 8 for size in self.param_sizes):
            raise DriverUnavailable(f"kernel {name} takes parameters of sizes {self.param_sizes}, not only pointers")
        count = len(self.param_sizes)
        self._values = (ctypes.c_uint64 * count)()  # one slot per parameter; the argv array points at them
        base = ctypes.addressof(self._values)
        self._argv = (_P * count)(*[base + 8 * i for i in range(count)])
        self._argv_address = ctypes.addressof(self._argv)
        self._lock = threading.Lock()
        self._filled = 0  # slots [0, _filled) hold the last launch's pointers, the others are null

    def set_carveout(self, percent: int) -> None:
        """The preferred shared-memory carveout of this kernel's later launches (-1: the driver's choice, 0: the
        most L1, 100: the most shared memory, what XLA's launches of kernels with dynamic shared memory amount to:
        ``python -m bench carveout``)."""
        _check(self._lib, self._lib.cuFuncSetAttribute(_P(self.function), _CARVEOUT, percent), "cuFuncSetAttribute")

    def _attribute(self, function: ctypes.c_void_p, attribute: int) -> int:
        value = _I()
        _check(self._lib, self._lib.cuFuncGetAttribute(ctypes.byref(value), attribute, function), "cuFuncGetAttribute")
        return value.value

    def _param_sizes(self, function: ctypes.c_void_p) -> tuple[int, ...]:
        sizes, offset, size = [], _S(), _S()
        while not self._lib.cuFuncGetParamInfo(function, len(sizes), ctypes.byref(offset), ctypes.byref(size)):
            sizes.append(size.value)
        return tuple(sizes)

    def bind(self, grid: tuple[int, int, int], threads: int) -> Callable[[int, Sequence[int]], None]:
        """``go(stream, pointers)``: launch with fixed ``grid`` and ``threads`` on ``stream`` (a raw
        ``cudaStream_t``) with ``pointers`` as the first parameters (one driver call, little else: the bridge's
        per-call budget is a few µs). Parameter slots past the pointers are null."""
        count, name, values, lock = len(self.param_sizes), self.name, self._values, self._lock
        call = functools.partial(self._lib.cuLaunchKernel, self.function, *grid, threads, 1, 1, self.shared_bytes)
        argv, lib, context = self._argv_address, self._lib, _P(self.context)

        def go(stream: int, pointers: Sequence[int]) -> None:
            n = len(pointers)
            if n > count:
                raise ValueError(f"kernel {name} takes {count} parameters, got {n}")
            with lock:  # the argument slots are shared: fill and launch as one step
                if n < self._filled:  # a launch with more pointers came before: null the slots past ours
                    values[n:self._filled] = [0] * (self._filled - n)
                values[:n] = pointers
                self._filled = n
                err = call(stream, argv, None)
                if err == _INVALID_CONTEXT:  # left without one (the module docstring says when)
                    _check(lib, lib.cuCtxSetCurrent(context), "cuCtxSetCurrent")  # torch's primary context
                    err = call(stream, argv, None)
            if err:
                _check(lib, err, f"launching {name}")

        return go

    def launch(self, grid: tuple[int, int, int], threads: int, stream: int, pointers: Sequence[int]) -> None:
        """Launch once on ``stream`` with ``pointers`` as the first parameters (``bind`` for repeated launches)."""
        self.bind(grid, threads)(stream, pointers)
