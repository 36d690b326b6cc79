"""The general route: torch tensors → JAX arrays (DLPack, zero-copy) → the Pallas kernels' JAX functions →
torch tensors (DLPack, zero-copy).

Stream order, with no host synchronisation:

* in: ``jax.dlpack.from_dlpack`` hands the producer (torch) JAX's stream, and torch makes that stream wait
  for the work already queued on torch's **current** stream;
* out: ``torch.from_dlpack`` hands JAX torch's current stream, and JAX makes it wait for the kernel.

The outputs stay JAX-owned buffers viewed by torch; JAX frees them when the torch tensor dies. Work on
other torch streams than the current one needs ``Tensor.record_stream``-style care, as for any tensor.

One ``jax.jit`` function per (kind, mode, impl), cached; jit compiles once per shape and dtypes and its C++
dispatch is the fastest way into the executable: a call is one import per input, one dispatch, one export
per output. Tensors come in any leading shape (contiguous, at least one row): the reshape to the kernels' 2-D
happens inside the jitted function, where XLA makes it a free bitcast.

Why a large call is slow here (H100, 32768×4096 bf16 forward: ~0.53 ms against 0.19 ms for the same kernel
called from JAX; 2026-11): no step waits on the GPU. The route is host-bound: measured per call, ``to_jax``
costs 35–160 µs per tensor, the jitted call's dispatch 40–150 µs and ``to_torch`` 13–200 µs per array (the
larger figures for large buffers), so with two inputs and two outputs the host spends ~0.3–0.6 ms per call,
longer than the kernel, and the GPU idles between calls. A CUDA graph cannot capture it either: JAX launches on
its own stream. The launch route (``launch_route``, the default on CUDA) runs the same binaries without this.
"""

from __future__ import annotations

import functools

import jax
import torch

from pallas_norm import api, compat
from torch_bridge.jax_device import JAX_DTYPES, jax_device_for

_KDL_CUDA = 2


@functools.lru_cache(maxsize=None)
def _ready_stream(device: jax.Device) -> int | None:
    """The stream JAX asks producers to order their pending work before (what ``from_dlpack`` passes)."""
    return device.get_stream_for_external_ready_events()


def to_jax(t: torch.Tensor, device: jax.Device) -> jax.Array:
    """Zero-copy view of ``t`` as a JAX array (``t`` must be contiguous; XLA needs aligned buffers).

    For CUDA tensors torch makes JAX's stream wait for the work queued on torch's current stream.
    """
    t = t.detach()
    import_buffer = compat.dlpack_importer() if t.is_cuda else None  # the public function's core, when present
    if import_buffer is None:
        return jax.dlpack.from_dlpack(t, device=device, copy=False)
    stream = _ready_stream(device)
    return import_buffer(t.__dlpack__(stream=stream), device, stream, False, _KDL_CUDA)


def to_torch(a: jax.Array) -> torch.Tensor:
    """Zero-copy view of ``a`` as a torch tensor, ordered after JAX's work on torch's current stream."""
    return torch.from_dlpack(a)


def _impl_for(device: jax.Device) -> str:
    return "auto" if device.platform == "gpu" else "interpret"


@functools.lru_cache(maxsize=None)
def _forward_jit(eps: float, offset: float, casting: str, impl: str, h_dtype=None):
    fn = api.forward_fn(eps, offset, casting, impl, None, h_dtype)
    k = 1 if h_dtype is None else 2  # row operands: x[, residual]; row results: y[, h]

    def run(*args):  # reshapes are free bitcasts in XLA; torch then gets x-shaped tensors, not views
        shape = args[0].shape
        outs = fn(*(a.reshape(-1, shape[-1]) for a in args[:k]), *args[k:])
        return (*(o.reshape(shape) for o in outs[:k]), outs[k].reshape(shape[:-1]))

    return jax.jit(run)


@functools.lru_cache(maxsize=None)
def _backward_jit(offset: float, casting: str, impl: str, has_weight: bool, fused: bool = False):
    fn = api.backward_fn(offset, casting, impl, has_weight, None, fused)

    def run(x, *rest):  # rest: *weight, dy[, dh_out], rstd
        n = x.shape[-1]
        cts = rest[has_weight:-1]
        dx, dweight = fn(x.reshape(-1, n), *rest[:has_weight], *(c.reshape(-1, n) for c in cts),
                         rest[-1].reshape(-1))
        return dx.reshape(x.shape), dweight

    return jax.jit(run)


def forward(x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, casting: str
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, rstd)`` (shapes ``x.shape`` and ``x.shape[:-1]``) via the JAX function ``api.forward_fn``."""
    device = jax_device_for(x)
    args = [to_jax(x, device)] + ([] if weight is None else [to_jax(weight, device)])
    y, rstd = _forward_jit(eps, offset, casting, _impl_for(device))(*args)
    return to_torch(y), to_torch(rstd)


def add_forward(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float,
                casting: str, h_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused add's ``(y, h, rstd)`` via ``api.forward_fn`` with ``h_dtype``."""
    device = jax_device_for(x)
    args = [to_jax(x, device), to_jax(residual, device)] + ([] if weight is None else [to_jax(weight, device)])
    outs = _forward_jit(eps, offset, casting, _impl_for(device), JAX_DTYPES[h_dtype])(*args)
    return tuple(to_torch(o) for o in outs)


def add_backward(dy: torch.Tensor, dh_out: torch.Tensor, h: torch.Tensor, weight: torch.Tensor | None,
                 rstd: torch.Tensor, offset: float, casting: str, need_dweight: bool
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fused add's ``(dh, dweight)`` via ``api.backward_fn(..., fused=True)``."""
    device = jax_device_for(h)
    args = [to_jax(h, device)] + ([] if weight is None else [to_jax(weight, device)])
    fn = _backward_jit(offset, casting, _impl_for(device), weight is not None, True)
    dh, dweight = fn(*args, to_jax(dy, device), to_jax(dh_out, device), to_jax(rstd, device))
    return to_torch(dh), (to_torch(dweight) if need_dweight and dweight is not None else None)


def backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor,
             offset: float, casting: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(dx, dweight)`` via ``api.backward_fn``; ``dweight`` is None without weight."""
    device = jax_device_for(x)
    args = [to_jax(x, device)] + ([] if weight is None else [to_jax(weight, device)])
    fn = _backward_jit(offset, casting, _impl_for(device), weight is not None)
    dx, dweight = fn(*args, to_jax(dy, device), to_jax(rstd, device))
    return to_torch(dx), (None if dweight is None else to_torch(dweight))
