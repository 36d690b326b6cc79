"""The Pallas kernels as torch backends (``custom_ops`` family ``"pallas"``: ``pallas_norm::pallas_rms_norm_fwd/bwd``).

* ``"pallas_launch"`` (the default ``backend="pallas"`` on CUDA): the binaries XLA compiled for the JAX functions
  ``pallas_norm.rms_norm`` runs, launched on torch's current stream (``launch_route``): JAX's bits, a few µs of
  host time per kernel, CUDA-graph capturable. It falls back to ``"pallas_dlpack"``, with a warning once per
  shape, when the lowered module is not a plain chain of kernels or the binaries cannot be had or loaded;
* ``"pallas_dlpack"`` (the default elsewhere): any device JAX sees: a zero-copy DLPack hand-off to the same JAX
  functions, run by JAX (``dlpack_route``); on CPU tensors the kernels run under Pallas's interpreter.

The backward computes ``dx`` and ``dweight`` together (one JAX function); what autograd did not ask for is
dropped.
"""

from __future__ import annotations

import warnings

import torch

from torch_bridge import custom_ops, dlpack_route, fused_ops, launch_route

_LAUNCHERS: dict[tuple, launch_route.Launcher | None] = {}  # (kind, key, device) -> launcher; None: unsupported


def _launcher(launcher_fn, key: tuple, x: torch.Tensor):
    """The launch route's compiled program for ``key`` on x's GPU, or None when its module cannot be launched
    directly (warned once per key; the caller then takes the DLPack route). A dict in front of the route's own
    cache: a hit is one lookup."""
    slot = (launcher_fn, key, x.get_device())
    try:
        return _LAUNCHERS[slot]
    except KeyError:
        pass
    try:
        launcher = launcher_fn(*key, slot[2])
    except launch_route.UnsupportedProgram as err:
        warnings.warn(f"pallas_norm: direct launch unavailable ({err}); using the DLPack route", RuntimeWarning,
                      stacklevel=2)
        launcher = None
    _LAUNCHERS[slot] = launcher
    return launcher


def _dlpack_backward(dy, x, weight, rstd, offset, casting, need_dx, need_dweight):
    dx, dweight = dlpack_route.backward(dy, x, weight, rstd, offset, casting)
    return (dx if need_dx else None), (dweight if need_dweight else None)


def _forward_launcher(x, weight, eps, offset, casting, m: int, n: int):
    return _launcher(launch_route.forward_launcher, (m, n, x.dtype, custom_ops.dtype_of(weight), eps, offset, casting),
                     x)


def _launch_forward(x, weight, eps, offset, casting):
    launcher = _forward_launcher(x, weight, eps, offset, casting, *custom_ops.rows(x))
    if launcher is None:
        return dlpack_route.forward(x, weight, eps, offset, casting)
    # kernels see pointers: x goes in N-d; y is made like x, rstd in x's leading shape
    return launcher(*((x,) if weight is None else (x, weight)), out=(None, x.shape[:-1]))


def _launch_forward_y(x, weight, eps, offset, casting):
    """``y`` alone (no gradient will be asked for): rstd goes to a scratch buffer, one allocation fewer."""
    m, n = custom_ops.rows(x)
    launcher = _forward_launcher(x, weight, eps, offset, casting, m, n)
    if launcher is None:
        return dlpack_route.forward(x, weight, eps, offset, casting)[0]
    return launcher(*((x,) if weight is None else (x, weight)), out=(None, custom_ops.rstd_scratch(x, m)))[0]


def _launch_backward(dy, x, weight, rstd, offset, casting, need_dx, need_dweight):
    key = (*custom_ops.rows(x), x.dtype, custom_ops.dtype_of(weight), offset, casting)
    launcher = _launcher(launch_route.backward_launcher, key, x)
    if launcher is None:
        return _dlpack_backward(dy, x, weight, rstd, offset, casting, need_dx, need_dweight)
    inputs = (x, dy, rstd) if weight is None else (x, weight, dy, rstd)
    out = launcher(*inputs)  # dx is made like x, dweight like weight
    return (out[0] if need_dx else None), (out[1] if need_dweight else None)


def _add_forward_launcher(m, n, x_dtype, w_dtype, eps, offset, casting, residual_dtype, h_dtype, device):
    return launch_route.forward_launcher(m, n, x_dtype, w_dtype, eps, offset, casting, device, None, residual_dtype,
                                         h_dtype)


def _add_backward_launcher(m, n, h_dtype, w_dtype, offset, casting, device):
    return launch_route.backward_launcher(m, n, h_dtype, w_dtype, offset, casting, device, None, True)


def _launch_add_forward(x, residual, weight, eps, offset, casting, h_dtype):
    key = (*custom_ops.rows(x), x.dtype, custom_ops.dtype_of(weight), eps, offset, casting, residual.dtype, h_dtype)
    launcher = _launcher(_add_forward_launcher, key, x)
    if launcher is None:
        return dlpack_route.add_forward(x, residual, weight, eps, offset, casting, h_dtype)
    # y and h are made like residual when it has their dtype, else in x's shape; rstd in x's leading shape
    return launcher(x, residual, *(() if weight is None else (weight,)), out=(x.shape, x.shape, x.shape[:-1]))


def _launch_add_backward(dy, dh_out, h, weight, rstd, offset, casting, need_dweight):
    key = (*custom_ops.rows(h), h.dtype, custom_ops.dtype_of(weight), offset, casting)
    launcher = _launcher(_add_backward_launcher, key, h)
    if launcher is None:
        return dlpack_route.add_backward(dy, dh_out, h, weight, rstd, offset, casting, need_dweight)
    out = launcher(h, *(() if weight is None else (weight,)), dy, dh_out, rstd)
    return out[0], (out[1] if need_dweight and weight is not None else None)


custom_ops.define("pallas", {
    "pallas_launch": custom_ops.Kernels(_launch_forward, _launch_backward, _launch_forward_y),
    "pallas_dlpack": custom_ops.Kernels(dlpack_route.forward, _dlpack_backward),
})
fused_ops.define("pallas", {
    "pallas_launch": fused_ops.AddKernels(_launch_add_forward, _launch_add_backward),
    "pallas_dlpack": fused_ops.AddKernels(dlpack_route.add_forward, dlpack_route.add_backward),
})
