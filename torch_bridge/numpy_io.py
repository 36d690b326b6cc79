"""Torch tensors to and from NumPy for ``pallas_norm.accuracy`` (bfloat16 included), and a norm's autograd
outputs ``(y, dx, dweight)``: what ``patch_hf_model(verify=True)`` and the cross-stack tools judge."""

from __future__ import annotations

from collections.abc import Callable

import ml_dtypes
import numpy as np
import torch

_BITS = {torch.bfloat16: (torch.int16, ml_dtypes.bfloat16)}
_TORCH = {np.dtype(np.float16): torch.float16, np.dtype(ml_dtypes.bfloat16): torch.bfloat16,
          np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64}


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The NumPy dtype of a torch floating dtype (``ml_dtypes.bfloat16`` for bfloat16)."""
    return next(k for k, v in _TORCH.items() if v == dtype)


def to_numpy(t: torch.Tensor | None) -> np.ndarray | None:
    """A host NumPy copy with the same dtype (bfloat16 as ``ml_dtypes.bfloat16``, bit for bit)."""
    if t is None:
        return None
    t = t.detach().cpu()
    if t.dtype in _BITS:
        as_int, np_dtype = _BITS[t.dtype]
        return t.contiguous().view(as_int).numpy().view(np_dtype)
    return t.numpy()


def from_numpy(a: np.ndarray, device: str | torch.device = "cpu") -> torch.Tensor:
    """A torch-allocated tensor (aligned as torch aligns) with ``a``'s values and dtype on ``device``."""
    a = np.require(a, requirements=("C", "W"))  # torch refuses read-only buffers (e.g. views of JAX arrays)
    dtype = _TORCH[a.dtype]
    t = torch.from_numpy(a.view(np.int16)).view(dtype) if dtype in _BITS else torch.from_numpy(a)
    return t.to(device, copy=True)


def autograd_outputs(fn: Callable, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, dx, dweight)`` of ``y = fn(x, w)`` with cotangent ``dy``, by torch autograd on copies of the inputs."""
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y = fn(xr, wr)
    dx, dw = torch.autograd.grad(y, (xr, wr), dy)
    return y.detach(), dx, dw
