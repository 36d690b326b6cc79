"""The Pallas kernels as torch backends (``custom_ops`` family ``"pallas"``: ``pallas_norm::pallas_rms_norm_fwd/bwd``).

* ``"pallas_dlpack"`` (the default ``backend="pallas"``): any device JAX sees: a zero-copy DLPack hand-off to the
  JAX functions ``pallas_norm.rms_norm`` runs, so the bits are JAX's (``dlpack_route``); on CPU tensors the
  kernels run under Pallas's interpreter;
* ``"pallas_launch"``: CUDA only: the Pallas-generated Triton IR compiled by torch's Triton and launched on
  torch's current stream (``launch_route``): far less host time per call, but a different Triton compiles the
  IR, so results may differ from JAX's in the last bits (reduction order). It falls back to ``"pallas_dlpack"``,
  with a warning, for a lowered module that is not a plain chain of kernels.

The backward computes ``dx`` and ``dweight`` together (one JAX function); what autograd did not ask for is
dropped.
"""

from __future__ import annotations

import warnings

import torch

from torch_bridge import custom_ops, dlpack_route, launch_route

_unsupported: set[tuple] = set()  # launch-route keys whose lowered module is not a plain kernel chain


def _launcher(launcher_fn, key: tuple, x: torch.Tensor):
    """The launch route's compiled program for ``key``, or None when its module cannot be launched directly
    (warned once per key; the caller then takes the DLPack route)."""
    if key in _unsupported:
        return None
    try:
        return launcher_fn(*key, x.device.index)
    except launch_route.UnsupportedProgram as err:
        _unsupported.add(key)
        warnings.warn(f"pallas_norm: direct launch unavailable ({err}); using the DLPack route", RuntimeWarning,
                      stacklevel=2)
        return None


def _rows(x: torch.Tensor) -> tuple[int, int]:
    n = x.shape[-1]
    return x.numel() // n, n


def _dtype(t: torch.Tensor | None) -> torch.dtype | None:
    return None if t is None else t.dtype


def _dlpack_backward(dy, x, weight, rstd, offset, casting, need_dx, need_dweight):
    dx, dweight = dlpack_route.backward(dy, x, weight, rstd, offset, casting)
    return (dx if need_dx else None), (dweight if need_dweight else None)


def _launch_forward(x, weight, eps, offset, casting):
    launcher = _launcher(launch_route.forward_launcher, (*_rows(x), x.dtype, _dtype(weight), eps, offset, casting), x)
    if launcher is None:
        return dlpack_route.forward(x, weight, eps, offset, casting)
    # kernels see pointers: x goes in N-d, outputs come out in x's shape
    return launcher(*((x,) if weight is None else (x, weight)), out_shapes=(x.shape, x.shape[:-1]))


def _launch_backward(dy, x, weight, rstd, offset, casting, need_dx, need_dweight):
    key = (*_rows(x), x.dtype, _dtype(weight), offset, casting)
    launcher = _launcher(launch_route.backward_launcher, key, x)
    if launcher is None:
        return _dlpack_backward(dy, x, weight, rstd, offset, casting, need_dx, need_dweight)
    inputs = (x, dy, rstd) if weight is None else (x, weight, dy, rstd)
    out = launcher(*inputs, out_shapes=(x.shape, (x.shape[-1],)))
    return (out[0] if need_dx else None), (out[1] if need_dweight else None)


custom_ops.define("pallas", {
    "pallas_launch": custom_ops.Kernels(_launch_forward, _launch_backward),
    "pallas_dlpack": custom_ops.Kernels(dlpack_route.forward, _dlpack_backward),
})
