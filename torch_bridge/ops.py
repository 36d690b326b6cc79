"""PyTorch entry point: argument checks, ``torch.library`` custom ops and their autograd.

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

from pallas_norm.semantics import check_scalars
from torch_bridge import reference, triton_kernels

BACKENDS: tuple[str, ...] = ("triton",)
FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


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


def check_tensors(x: object, weight: object) -> None:
    """Raise TypeError/ValueError naming the argument when x or weight is unusable."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"x must have a floating dtype in {FLOAT_DTYPES}, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("x must have at least 1 dimension (rows are the last axis), got a 0-d tensor")
    if x.shape[-1] == 0:
        raise ValueError(f"x's last dimension (N) must be >= 1, got shape {tuple(x.shape)}")
    if weight is None:
        return
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor or None, got {type(weight).__name__}")
    if weight.dtype not in FLOAT_DTYPES:
        raise TypeError(f"weight must have a floating dtype in {FLOAT_DTYPES}, got {weight.dtype}")
    if tuple(weight.shape) != (x.shape[-1],):
        raise ValueError(f"weight must have shape ({x.shape[-1]},) (x's last dimension), got {tuple(weight.shape)}")
    if weight.device != x.device:
        raise ValueError(f"weight must be on x's device {x.device}, got {weight.device}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6, *, offset: float = 0.0,
             casting: str = "llama", backend: str = "triton") -> torch.Tensor:
    """RMSNorm over the last axis, ``y = r(n * (weight + offset))`` per docs/semantics.md; autograd-aware.

    ``casting`` in ("llama", "gemma", "none"); ``offset=1.0`` with zero-initialised weights gives Gemma.
    Output has x's dtype and shape; non-contiguous x (and weight) are copied to contiguous memory first.
    Never writes into its inputs (nor into the cotangent in the backward).
    """
    eps, offset, casting = check_scalars(eps, offset, casting, has_weight=weight is not None)
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    check_tensors(x, weight)
    if weight is not None:
        weight = weight.contiguous()
    y, _ = torch.ops.pallas_norm.triton_rms_norm_fwd(x.contiguous(), weight, eps, offset, casting)
    return y
