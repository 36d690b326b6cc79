"""The Triton reference kernel as ``torch.library`` custom ops, with their autograd.

Ops (namespace ``pallas_norm``), opaque to ``torch.compile`` (traced through their fake kernels):

* ``triton_rms_norm_fwd(x, weight?, eps, offset, casting) -> (y, rstd)``
* ``triton_rms_norm_bwd(dy, x, weight?, rstd, offset, casting, need_dx, need_dweight) -> (dx, dweight)``;
  an output that is not needed comes back as an empty tensor of shape (0,).

Both take ``x`` contiguous with any leading shape and flatten it to 2-D. CUDA tensors run the Triton
kernels; CPU tensors run them under Triton's interpreter when ``TRITON_INTERPRET=1`` was set before
import, else fall back to the plain-torch naive formula (same semantics and rounding points).
"""

from __future__ import annotations

import torch

from torch_bridge import reference, triton_kernels
from torch_bridge.jax_device import current_device_of


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda or (triton_kernels.INTERPRET and x.device.type == "cpu")


def _rstd_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


@torch.library.custom_op("pallas_norm::triton_rms_norm_fwd", mutates_args=())
def triton_rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float,
                        casting: str) -> tuple[torch.Tensor, torch.Tensor]:
    """y = r(n * (w + offset)), rstd = rsqrt(mean(x*x) + eps) (float32; float64 for float64 x)."""
    x2 = x.reshape(-1, x.shape[-1])
    if _use_triton(x):
        with current_device_of(x):  # Triton launches on the current device
            y, rstd = triton_kernels.rms_norm_fwd(x2, weight, eps, offset, casting)
    else:
        y, rstd = reference.rms_norm_ref_forward(x2, weight, eps, offset=offset, casting=casting,
                                                 compute_dtype=_rstd_dtype(x), keep_roundings=True)
    return y.reshape(x.shape), rstd.reshape(x.shape[:-1])


@triton_rms_norm_fwd.register_fake
def _(x, weight, eps, offset, casting):
    return torch.empty_like(x), x.new_empty(x.shape[:-1], dtype=_rstd_dtype(x))


@torch.library.custom_op("pallas_norm::triton_rms_norm_bwd", mutates_args=())
def triton_rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor,
                        offset: float, casting: str, need_dx: bool, need_dweight: bool
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """dx = r(rstd * (g - x * rstd^2 * mean(g * x))) in a new buffer; dweight = sum_rows dy * n."""
    n = x.shape[-1]
    x2, dy2 = x.reshape(-1, n), dy.reshape(-1, n)
    need_dweight = need_dweight and weight is not None
    if _use_triton(x):
        with current_device_of(x):
            dx, dweight = triton_kernels.rms_norm_bwd(dy2, x2, weight, rstd.reshape(-1), offset, casting,
                                                      need_dx, need_dweight)
    else:
        dx, dweight = reference.rms_norm_ref_backward(dy2, x2, weight, offset=offset, casting=casting,
                                                      compute_dtype=_rstd_dtype(x), keep_roundings=True,
                                                      rstd=rstd.reshape(-1))
        if x2.shape[0] == 0 and dweight is not None:
            dweight = torch.zeros_like(weight)
    empty = x.new_empty((0,))
    dx = dx.reshape(x.shape) if need_dx else empty
    dweight = dweight if need_dweight else empty.clone()
    return dx, dweight


@triton_rms_norm_bwd.register_fake
def _(dy, x, weight, rstd, offset, casting, need_dx, need_dweight):
    dx = torch.empty_like(x) if need_dx else x.new_empty((0,))
    dweight = torch.empty_like(weight) if (need_dweight and weight is not None) else x.new_empty((0,))
    return dx, dweight


def _setup_context(ctx, inputs, output) -> None:
    x, weight, eps, offset, casting = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.offset, ctx.casting = offset, casting
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, dy: torch.Tensor, _drstd: torch.Tensor | None):
    x, weight, rstd = ctx.saved_tensors
    need_dx = ctx.needs_input_grad[0]
    need_dweight = weight is not None and ctx.needs_input_grad[1]
    dx, dweight = torch.ops.pallas_norm.triton_rms_norm_bwd(dy.contiguous(), x, weight, rstd, ctx.offset,
                                                            ctx.casting, need_dx, need_dweight)
    return (dx if need_dx else None), (dweight if need_dweight else None), None, None, None


triton_rms_norm_fwd.register_autograd(_backward, setup_context=_setup_context)
