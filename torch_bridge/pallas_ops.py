"""The Pallas kernels as torch ops: route choice, ``torch.library`` custom ops, and the eager autograd path.

Routes (``route`` argument):

* ``"dlpack"`` (backend ``"pallas"``): any device JAX sees: zero-copy DLPack hand-off to the JAX functions that
  ``pallas_norm.rms_norm`` runs, so the bits are JAX's (``dlpack_route``); on CPU tensors the kernels run under
  Pallas's interpreter;
* ``"launch"`` (backend ``"pallas_launch"``): CUDA only: the Pallas-generated Triton IR compiled by torch's
  Triton and launched on torch's current stream (``launch_route``): far less host time per call, but a
  different Triton compiles the IR, so results may differ from JAX's in the last bits (reduction order). It
  falls back to ``"dlpack"``, with a warning, for a lowered module that is not a plain chain of kernels.

Ops (namespace ``pallas_norm``), opaque to ``torch.compile`` through their fake kernels:

* ``pallas_rms_norm_fwd(x, weight?, eps, offset, casting, route) -> (y, rstd)``
* ``pallas_rms_norm_bwd(dy, x, weight?, rstd, offset, casting, route) -> (dx, dweight)``; ``dweight`` is an
  empty (0,) tensor without weight.

Eager calls skip the custom-op dispatcher (``PallasRMSNormFunction``, same implementation functions): the
dispatcher costs more than the kernel at small sizes. Under ``torch.compile`` the custom ops are used.
"""

from __future__ import annotations

import warnings

import torch

from torch_bridge import dlpack_route, launch_route
from torch_bridge.jax_device import current_device_of

ROUTES: tuple[str, ...] = ("dlpack", "launch")
_unsupported: set[tuple] = set()  # launch-route keys whose lowered module is not a plain kernel chain


def kernel_ready(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous and 32-byte aligned (the kernels' pointer contract); copies only when it is not."""
    if not t.is_contiguous():
        t = t.contiguous()
    return t if t.data_ptr() % 32 == 0 else t.clone()


def _check_route(route: object) -> None:
    if route not in ROUTES:
        raise ValueError(f"route must be one of {ROUTES}, got {route!r}")


def _launcher(launcher_fn, key: tuple, x: torch.Tensor):
    """The launch route's compiled program for ``key``, or None when its module cannot be launched directly
    (warned once per key; the caller then takes the DLPack route)."""
    if not x.is_cuda:
        raise ValueError(f"backend 'pallas_launch' needs CUDA tensors, got x on {x.device}")
    if key in _unsupported:
        return None
    try:
        return launcher_fn(*key, x.device.index)
    except launch_route.UnsupportedProgram as err:
        _unsupported.add(key)
        warnings.warn(f"pallas_norm: direct launch unavailable ({err}); using the DLPack route", RuntimeWarning,
                      stacklevel=5)
        return None


def forward_impl(x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, casting: str,
                 route: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, rstd)``: y in x's shape and dtype, rstd float32 of shape ``x.shape[:-1]``; runs with x's GPU current
    (torch's current device is restored afterwards)."""
    with current_device_of(x):
        return _forward(x, weight, eps, offset, casting, route)


def backward_impl(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor,
                  offset: float, casting: str, route: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(dx, dweight)``; dx in a new buffer (dy is only read), dweight None without weight; runs with x's GPU
    current."""
    with current_device_of(x):
        return _backward(dy, x, weight, rstd, offset, casting, route)


def _forward(x, weight, eps, offset, casting, route):
    x, weight = kernel_ready(x), None if weight is None else kernel_ready(weight)
    n = x.shape[-1]
    m = x.numel() // n
    if m == 0:
        return torch.empty_like(x), x.new_empty(x.shape[:-1], dtype=torch.float32)
    if route == "launch":
        key = (m, n, x.dtype, None if weight is None else weight.dtype, eps, offset, casting)
        launcher = _launcher(launch_route.forward_launcher, key, x)
        if launcher is not None:  # kernels see pointers: x goes in N-d, outputs come out in x's shape
            return launcher(*((x,) if weight is None else (x, weight)), out_shapes=(x.shape, x.shape[:-1]))
    return dlpack_route.forward(x, weight, eps, offset, casting)


def _backward(dy, x, weight, rstd, offset, casting, route):
    x, dy, rstd = kernel_ready(x), kernel_ready(dy), kernel_ready(rstd)
    weight = None if weight is None else kernel_ready(weight)
    n = x.shape[-1]
    m = x.numel() // n
    if m == 0:
        return torch.empty_like(x), None if weight is None else torch.zeros_like(weight)
    if route == "launch":
        key = (m, n, x.dtype, None if weight is None else weight.dtype, offset, casting)
        launcher = _launcher(launch_route.backward_launcher, key, x)
        if launcher is not None:
            inputs = (x, dy, rstd) if weight is None else (x, weight, dy, rstd)
            out = launcher(*inputs, out_shapes=(x.shape, (n,)))
            return out[0], (out[1] if weight is not None else None)
    return dlpack_route.backward(dy, x, weight, rstd, offset, casting)


@torch.library.custom_op("pallas_norm::pallas_rms_norm_fwd", mutates_args=())
def pallas_rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, casting: str,
                        route: str) -> tuple[torch.Tensor, torch.Tensor]:
    """y = r(n * (w + offset)), rstd = rsqrt(mean(x*x) + eps) in float32, by the Pallas forward kernel."""
    _check_route(route)
    return forward_impl(x, weight, eps, offset, casting, route)


@pallas_rms_norm_fwd.register_fake
def _(x, weight, eps, offset, casting, route):
    return torch.empty_like(x), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("pallas_norm::pallas_rms_norm_bwd", mutates_args=())
def pallas_rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor,
                        offset: float, casting: str, route: str) -> tuple[torch.Tensor, torch.Tensor]:
    """dx = r(rstd * (g - x * rstd^2 * mean(g * x))), dweight = sum_rows dy * n, by the Pallas backward."""
    _check_route(route)
    dx, dweight = backward_impl(dy, x, weight, rstd, offset, casting, route)
    return dx, (x.new_empty((0,)) if dweight is None else dweight)


@pallas_rms_norm_bwd.register_fake
def _(dy, x, weight, rstd, offset, casting, route):
    return torch.empty_like(x), (x.new_empty((0,)) if weight is None else torch.empty_like(weight))


def _setup_context(ctx, inputs, output) -> None:
    x, weight, eps, offset, casting, route = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.offset, ctx.casting, ctx.route = offset, casting, route
    ctx.mark_non_differentiable(output[1])


def _input_grads(ctx, weight: torch.Tensor | None, dx: torch.Tensor, dweight: torch.Tensor | None) -> tuple:
    """Gradients for (x, weight, eps, offset, casting, route), None where autograd did not ask."""
    need_dweight = weight is not None and ctx.needs_input_grad[1]
    return (dx if ctx.needs_input_grad[0] else None), (dweight if need_dweight else None), None, None, None, None


def _op_backward(ctx, dy: torch.Tensor, _drstd: torch.Tensor | None):
    x, weight, rstd = ctx.saved_tensors
    dx, dweight = torch.ops.pallas_norm.pallas_rms_norm_bwd(dy.contiguous(), x, weight, rstd, ctx.offset,
                                                            ctx.casting, ctx.route)
    return _input_grads(ctx, weight, dx, dweight)


pallas_rms_norm_fwd.register_autograd(_op_backward, setup_context=_setup_context)


class PallasRMSNormFunction(torch.autograd.Function):
    """Eager autograd path over the same ``forward_impl``/``backward_impl`` as the custom ops."""

    @staticmethod
    def forward(ctx, x, weight, eps, offset, casting, route):
        y, rstd = forward_impl(x, weight, eps, offset, casting, route)
        ctx.save_for_backward(x, weight, rstd)
        ctx.offset, ctx.casting, ctx.route = offset, casting, route
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dweight = backward_impl(dy, x, weight, rstd, ctx.offset, ctx.casting, ctx.route)
        return _input_grads(ctx, weight, dx, dweight)
