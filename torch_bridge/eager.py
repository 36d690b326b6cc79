"""RMSNorm as plain torch operations, following docs/semantics.md with the casting mode's rounding points.

Computed in float32 (float64 for float64 inputs, where every rounding is the identity) by the row math of
``pallas_norm.rowmath``: the same "naive formula" that ``pallas_norm.accuracy`` evaluates in NumPy, here in torch,
for the Triton backend's CPU fallback (no Triton interpreter) and for tests that need a differentiable torch
formula. Accuracy judgements use ``pallas_norm.accuracy``, never this module.
"""

from __future__ import annotations

import torch

from pallas_norm import rowmath
from pallas_norm.semantics import check_scalars


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _rounder(dt: torch.dtype):
    """r(v): round v to dt and widen back."""
    return lambda v: v.to(dt).to(v.dtype)


def _w_eff(weight: torch.Tensor | None, offset: float, casting: str, cdt: torch.dtype, r):
    return None if weight is None else rowmath.effective_weight(weight.to(cdt), offset, casting, r)


def _rstd(x32: torch.Tensor, eps: float) -> torch.Tensor:
    return rowmath.rstd_from_sumsq((x32 * x32).sum(-1, keepdim=True), x32.shape[-1], eps, torch.rsqrt)


def rms_norm_ref_forward(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6, *,
                         offset: float = 0.0, casting: str = "llama") -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, rstd)``: rstd = rsqrt(mean(x*x) + eps) per row (shape x.shape[:-1], float32; float64 for float64 x),
    y = r(n * w_eff) in x's dtype."""
    eps, offset, casting = check_scalars(eps, offset, casting, has_weight=weight is not None)
    cdt, r = _compute_dtype(x), _rounder(x.dtype)
    x32 = x.to(cdt)
    rstd = _rstd(x32, eps)
    n = rowmath.normalized(x32, rstd, casting, r)
    y = rowmath.output(n, _w_eff(weight, offset, casting, cdt, r))
    return y.to(x.dtype), rstd.squeeze(-1)


def rms_norm_add_ref_forward(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None = None,
                             eps: float = 1e-6, *, offset: float = 0.0, casting: str = "llama",
                             h_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused add: ``(y, h, rstd)`` with ``h = r(x + residual)`` in ``h_dtype`` (default x's) and ``(y, rstd)``
    :func:`rms_norm_ref_forward` of ``h``."""
    h_dtype = h_dtype or x.dtype
    cdt = _compute_dtype(torch.empty((), dtype=h_dtype))
    h = rowmath.residual_add(x.to(cdt), residual.to(cdt), _rounder(h_dtype)).to(h_dtype)
    y, rstd = rms_norm_ref_forward(h, weight, eps, offset=offset, casting=casting)
    return y, h, rstd


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6, *, offset: float = 0.0,
                 casting: str = "llama") -> torch.Tensor:
    """``y`` of :func:`rms_norm_ref_forward`; differentiable by autograd. Use :func:`rms_norm_ref_backward` for the
    backward *as specified* (its rounding points differ from autograd through the rounded forward)."""
    return rms_norm_ref_forward(x, weight, eps, offset=offset, casting=casting)[0]


def rms_norm_ref_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6, *,
                          offset: float = 0.0, casting: str = "llama", rstd: torch.Tensor | None = None,
                          dh_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(dx, dweight)`` by the backward of docs/semantics.md:

        g  = dy * w_eff (r(.) for llama/none), dx = r(rstd * (g - x * rstd^2 * mean(g * x)))
        dweight = sum over rows of dy * n, returned in weight.dtype (None without weight)

    ``rstd`` (shape x.shape[:-1]) is recomputed from x when not given. With ``dh_out`` (the fused add's backward,
    ``x`` being ``h``): ``dx = r(dx_norm + dh_out)``.
    """
    eps, offset, casting = check_scalars(eps, offset, casting, has_weight=weight is not None)
    cdt, r = _compute_dtype(x), _rounder(x.dtype)
    x32 = x.to(cdt)
    rstd = _rstd(x32, eps) if rstd is None else rstd.to(cdt).unsqueeze(-1)
    dy32 = dy.to(cdt)
    g = rowmath.grad_scale(dy32, _w_eff(weight, offset, casting, cdt, r), casting, r)
    dx = rowmath.grad_input(x32, g, rstd, (g * x32).sum(-1, keepdim=True), x.shape[-1])
    if dh_out is not None:
        dx = rowmath.grad_residual(dx, dh_out.to(cdt))
    dx = dx.to(x.dtype)
    if weight is None:
        return dx, None
    dweight = rowmath.dweight_terms(dy32, rowmath.normalized(x32, rstd, casting, r)).reshape(-1, x.shape[-1]).sum(0)
    return dx, dweight.to(weight.dtype)
