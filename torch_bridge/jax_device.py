"""Which JAX device serves a torch tensor (and JAX's dtype for a torch dtype), and JAX's memory settings inside a
torch process.

JAX pre-allocates 75% of GPU memory on first use; in a process that also runs torch that starves torch's
caching allocator. Importing ``torch_bridge`` therefore sets ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` unless
the user set it (it only takes effect if JAX's GPU backend was not initialised before).
"""

from __future__ import annotations

import contextlib
import functools
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402  (after the environment default above)
import torch  # noqa: E402

JAX_DTYPES = {torch.float16: jax.numpy.float16, torch.bfloat16: jax.numpy.bfloat16, torch.float32: jax.numpy.float32}


@functools.lru_cache(maxsize=None)
def _gpu_devices() -> dict[int, jax.Device]:
    """JAX's GPUs by CUDA ordinal. Initialising JAX's GPU backend leaves another GPU current on this thread
    (it visits every device), so torch's current device is put back afterwards."""
    current = torch.cuda.current_device() if torch.cuda.is_available() else None
    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        return {}
    finally:
        if current is not None:
            torch.cuda.set_device(current)
    return {int(d.local_hardware_id): d for d in devices}


class _DeviceGuard:
    """``t``'s GPU current inside, the caller's current device restored on exit (cheaper than
    ``torch.cuda.device``: the bridge's per-call budget is a few µs)."""

    __slots__ = ("index", "previous")

    def __init__(self, index: int):
        self.index = index

    def __enter__(self) -> None:
        self.previous = _get_device()
        if self.previous != self.index:
            torch.cuda.set_device(self.index)

    def __exit__(self, *exc) -> None:
        if _get_device() != self.previous:
            torch.cuda.set_device(self.previous)


# torch.cuda.current_device() without its lazy-init check (a CUDA tensor exists here, so CUDA is initialised)
_get_device = getattr(torch._C, "_cuda_getDevice", None)


def current_device_of(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Make ``t``'s GPU torch's current device for the bridge's work, and restore the caller's current device
    afterwards, whatever JAX (initialising, compiling) set in between. Torch's DLPack export and "current
    stream" are per current device, so this is what keeps a rank's bridge on its own GPU and stream."""
    index = t.get_device()
    return _NO_GUARD if index < 0 else _DeviceGuard(index)


_NO_GUARD = contextlib.nullcontext()


def jax_device_for(t: torch.Tensor) -> jax.Device:
    """The JAX device holding the same memory as ``t`` (CPU, or the GPU with ``t``'s CUDA ordinal).

    Raises ValueError when JAX cannot see that device (no JAX GPU backend, a GPU hidden from JAX, or a
    device type JAX does not run on), naming the tensor's device and what JAX sees.
    """
    if t.device.type == "cpu":
        return jax.devices("cpu")[0]
    if t.device.type != "cuda":
        raise ValueError(f"x is on {t.device}; the Pallas backend runs on CPU or CUDA tensors")
    gpus = _gpu_devices()
    if not gpus:
        raise ValueError(f"x is on {t.device} but JAX sees no GPU (jax.devices() = {jax.devices()}); "
                         "install jax[cuda] matching torch's CUDA, or use backend='triton'")
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    if index not in gpus:
        raise ValueError(f"x is on cuda:{index} but JAX only sees GPUs {sorted(gpus)} (local hardware ids); "
                         "make the same GPUs visible to torch and JAX")
    return gpus[index]
