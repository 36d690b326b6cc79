"""The fused residual-add RMSNorm as custom ops, for every kernel family, and its one autograd path.

:func:`define` turns a family's fused kernels (``AddKernels``) into two ``torch.library`` custom ops with fakes:

* ``pallas_norm::<family>_rms_norm_add_fwd(x, residual, weight?, eps, offset, casting, h_dtype, backend)
  -> (y, h, rstd)`` with ``h = r(x + residual)`` in ``h_dtype`` and ``y`` its norm;
* ``pallas_norm::<family>_rms_norm_add_bwd(dy, dh_out, h, weight?, rstd, offset, casting, backend, need_dweight)
  -> (dh, dweight)``, ``dh = r(dx_norm + dh_out)``.

The backward takes the plain RMSNorm backward op (``custom_ops``) when ``h``'s own gradient is absent (``h``
unused), and ``dh_out`` alone when ``y``'s is. ``dx`` and ``dresidual`` are ``dh`` (cast to their inputs' dtypes:
the same tensor when the dtypes agree, as torch's own ``add`` returns one gradient to both operands).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from torch_bridge import custom_ops
from torch_bridge.custom_ops import kernel_ready, rstd_dtype
from torch_bridge.jax_device import current_device_of


@dataclasses.dataclass(frozen=True)
class AddKernels:
    """One backend's fused add. ``forward(x, residual, weight, eps, offset, casting, h_dtype) -> (y, h, rstd)``;
    ``backward(dy, dh_out, h, weight, rstd, offset, casting, need_dweight) -> (dh, dweight or None)``."""

    forward: Callable
    backward: Callable


_KERNELS: dict[str, AddKernels] = {}
_FAMILY: dict[str, str] = {}


def _kernels(backend: str) -> AddKernels:
    return custom_ops.lookup(_KERNELS, backend)


def forward(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float,
            casting: str, h_dtype: torch.dtype, backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, h, rstd)`` by ``backend``'s fused forward."""
    kernels = _kernels(backend)
    with current_device_of(x):
        if x.numel() == 0:
            y = x.new_empty(x.shape, dtype=h_dtype)
            return y, torch.empty_like(y), x.new_empty(x.shape[:-1], dtype=rstd_dtype(y))
        return kernels.forward(kernel_ready(x), kernel_ready(residual), kernel_ready(weight), eps, offset, casting,
                               h_dtype)


def backward(dy: torch.Tensor, dh_out: torch.Tensor, h: torch.Tensor, weight: torch.Tensor | None,
             rstd: torch.Tensor, offset: float, casting: str, backend: str, need_dweight: bool
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(dh, dweight)`` by ``backend``'s fused backward (``dh`` a new buffer; the cotangents are only read)."""
    kernels = _kernels(backend)
    need_dweight = need_dweight and weight is not None
    with current_device_of(h):
        if h.numel() == 0:
            return h.new_empty(h.shape), (torch.zeros_like(weight) if need_dweight else None)
        return kernels.backward(kernel_ready(dy), kernel_ready(dh_out), kernel_ready(h), kernel_ready(weight),
                                kernel_ready(rstd), offset, casting, need_dweight)


def _norm_backward(dy, h, weight, rstd, offset, casting, backend, need_dweight):
    return custom_ops.backward(dy, h, weight, rstd, offset, casting, backend, True, need_dweight)


def _grads(dy, dh_out, h, weight, rstd, offset, casting, backend, need_dweight, bwd=backward,
           norm_bwd=_norm_backward):
    """``(dh, dweight)`` whichever cotangents exist (None: that output was not used)."""
    if dy is None:
        dh = torch.zeros_like(h) if dh_out is None else dh_out
        return dh, (torch.zeros_like(weight) if need_dweight and weight is not None else None)
    if dh_out is None:
        return norm_bwd(dy, h, weight, rstd, offset, casting, backend, need_dweight)
    return bwd(dy, dh_out, h, weight, rstd, offset, casting, backend, need_dweight)


def _input_grads(ctx, dh, dweight):
    x_dtype, r_dtype = ctx.dtypes
    needs = ctx.needs_input_grad
    return ((dh.to(x_dtype) if needs[0] else None), (dh.to(r_dtype) if needs[1] else None),
            (dweight if needs[2] else None), None, None, None, None, None)


class _Function(torch.autograd.Function):
    """The eager autograd path, over the same ``forward``/``backward`` as the custom ops."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps, offset, casting, h_dtype, backend):
        y, h, rstd = forward(x, residual, weight, eps, offset, casting, h_dtype, backend)
        ctx.save_for_backward(h, weight, rstd)
        ctx.set_materialize_grads(False)
        ctx.offset, ctx.casting, ctx.backend, ctx.dtypes = offset, casting, backend, (x.dtype, residual.dtype)
        return y, h

    @staticmethod
    def backward(ctx, dy, dh_out):
        h, weight, rstd = ctx.saved_tensors
        dh, dweight = _grads(dy, dh_out, h, weight, rstd, ctx.offset, ctx.casting, ctx.backend,
                             ctx.needs_input_grad[2])
        return _input_grads(ctx, dh, dweight)


def define(family: str, backends: dict[str, AddKernels]) -> None:
    """Register ``backends`` and the ops ``pallas_norm::<family>_rms_norm_add_fwd/bwd`` that run them."""
    _KERNELS.update(backends)
    _FAMILY.update(dict.fromkeys(backends, family))

    def _check(backend: str) -> None:
        custom_ops.lookup(backends, backend)

    @torch.library.custom_op(f"pallas_norm::{family}_rms_norm_add_fwd", mutates_args=())
    def fwd_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float,
               casting: str, h_dtype: torch.dtype, backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        _check(backend)
        return forward(x, residual, weight, eps, offset, casting, h_dtype, backend)

    @fwd_op.register_fake
    def _(x, residual, weight, eps, offset, casting, h_dtype, backend):
        y = torch.empty_like(x, dtype=h_dtype)
        return y, torch.empty_like(y), x.new_empty(x.shape[:-1], dtype=rstd_dtype(y))

    @torch.library.custom_op(f"pallas_norm::{family}_rms_norm_add_bwd", mutates_args=())
    def bwd_op(dy: torch.Tensor, dh_out: torch.Tensor, h: torch.Tensor, weight: torch.Tensor | None,
               rstd: torch.Tensor, offset: float, casting: str, backend: str,
               need_dweight: bool) -> tuple[torch.Tensor, torch.Tensor]:
        _check(backend)
        dh, dweight = backward(dy, dh_out, h, weight, rstd, offset, casting, backend, need_dweight)
        return dh, (h.new_empty((0,)) if dweight is None else dweight)

    @bwd_op.register_fake
    def _(dy, dh_out, h, weight, rstd, offset, casting, backend, need_dweight):
        return torch.empty_like(h), (torch.empty_like(weight) if need_dweight and weight is not None
                                     else h.new_empty((0,)))

    norm_bwd_op = getattr(torch.ops.pallas_norm, f"{family}_rms_norm_bwd")

    def norm_bwd(dy, h, weight, rstd, offset, casting, backend, need_dweight):
        return norm_bwd_op(dy, h, weight, rstd, offset, casting, backend, True, need_dweight)

    def setup_context(ctx, inputs, output) -> None:
        x, residual, weight, eps, offset, casting, h_dtype, backend = inputs
        ctx.save_for_backward(output[1], weight, output[2])
        ctx.offset, ctx.casting, ctx.backend, ctx.dtypes = offset, casting, backend, (x.dtype, residual.dtype)
        ctx.mark_non_differentiable(output[2])

    def op_backward(ctx, dy, dh_out, _drstd):
        h, weight, rstd = ctx.saved_tensors
        need_dweight = weight is not None and ctx.needs_input_grad[2]
        dh, dweight = _grads(dy, dh_out, h, weight, rstd, ctx.offset, ctx.casting, ctx.backend, need_dweight,
                             bwd=bwd_op, norm_bwd=norm_bwd)
        return _input_grads(ctx, dh, dweight if need_dweight else None)

    fwd_op.register_autograd(op_backward, setup_context=setup_context)


_function_apply = super(torch.autograd.Function, _Function).apply


def apply(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float,
          casting: str, h_dtype: torch.dtype, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, h)`` by ``backend``, autograd-aware: the custom op under ``torch.compile``, else the eager path."""
    if torch.compiler.is_compiling():
        op = getattr(torch.ops.pallas_norm, f"{_FAMILY[backend]}_rms_norm_add_fwd")
        return op(x, residual, weight, eps, offset, casting, h_dtype, backend)[:2]
    tensors = (x, residual) if weight is None else (x, residual, weight)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        if custom_ops._functorch_active() or any(custom_ops._is_wrapped(t) for t in tensors):
            return _Function.apply(x, residual, weight, eps, offset, casting, h_dtype, backend)
        return _function_apply(x, residual, weight, eps, offset, casting, h_dtype, backend)
    return forward(x, residual, weight, eps, offset, casting, h_dtype, backend)[:2]
