"""RMSNorm as plain torch operations, following docs/semantics.md with the casting mode's rounding points.

Computed in float32 (float64 for float64 inputs, where every rounding is the identity): the same "naive
formula" that ``pallas_norm.accuracy`` evaluates in NumPy, here in torch, for the Triton backend's CPU fallback
(no Triton interpreter) and for tests that need a differentiable torch formula. Accuracy judgements use
``pallas_norm.accuracy``, never this module.
"""

from __future__ import annotations

import torch

from pallas_norm.semantics import check_scalars


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _rounder(dt: torch.dtype):
    """r(v): round v to dt and widen back."""
    return lambda v: v.to(dt).to(v.dtype)


def _w_eff(weight: torch.Tensor | None, offset: float, casting: str, cdt: torch.dtype, r):
    """f32(w) + offset; "none": f32(r(f32(r(w)) + offset)); None without weight."""
    if weight is None:
        return None
    w = weight.to(cdt)
    return r(r(w) + offset) if casting == "none" else w + offset


def _normalize(x32: torch.Tensor, rstd: torch.Tensor, casting: str, r) -> torch.Tensor:
    """n: llama r(x*rstd); gemma x*rstd; none r(x*r(rstd))."""
    if casting == "llama":
        return r(x32 * rstd)
    if casting == "gemma":
        return x32 * rstd
    return r(x32 * r(rstd))


def rms_norm_ref_forward(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6, *,
                         offset: float = 0.0, casting: str = "llama") -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, rstd)``: rstd = rsqrt(mean(x*x) + eps) per row (shape x.shape[:-1], float32; float64 for float64 x),
    y = r(n * w_eff) in x's dtype."""
    eps, offset, casting = check_scalars(eps, offset, casting, has_weight=weight is not None)
    cdt, r = _compute_dtype(x), _rounder(x.dtype)
    x32 = x.to(cdt)
    rstd = torch.rsqrt((x32 * x32).mean(-1, keepdim=True) + eps)
    n = _normalize(x32, rstd, casting, r)
    w_eff = _w_eff(weight, offset, casting, cdt, r)
    y = n if w_eff is None else n * w_eff
    return y.to(x.dtype), rstd.squeeze(-1)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6, *, offset: float = 0.0,
                 casting: str = "llama") -> torch.Tensor:
    """``y`` of :func:`rms_norm_ref_forward`; differentiable by autograd. Use :func:`rms_norm_ref_backward` for the
    backward *as specified* (its rounding points differ from autograd through the rounded forward)."""
    return rms_norm_ref_forward(x, weight, eps, offset=offset, casting=casting)[0]


def rms_norm_ref_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6, *,
                          offset: float = 0.0, casting: str = "llama", rstd: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(dx, dweight)`` by the backward of docs/semantics.md:

        g  = dy * w_eff (r(.) for llama/none), dx = r(rstd * (g - x * rstd^2 * mean(g * x)))
        dweight = sum over rows of dy * n, returned in weight.dtype (None without weight)

    ``rstd`` (shape x.shape[:-1]) is recomputed from x when not given.
    """
    eps, offset, casting = check_scalars(eps, offset, casting, has_weight=weight is not None)
    cdt, r = _compute_dtype(x), _rounder(x.dtype)
    x32 = x.to(cdt)
    if rstd is None:
        rstd = torch.rsqrt((x32 * x32).mean(-1) + eps)
    rstd = rstd.to(cdt).unsqueeze(-1)
    dy32 = dy.to(cdt)
    w_eff = _w_eff(weight, offset, casting, cdt, r)
    if w_eff is None:
        g = dy32
    else:
        g = dy32 * w_eff
        g = g if casting == "gemma" else r(g)
    dx = (rstd * (g - x32 * (rstd * rstd) * (g * x32).mean(-1, keepdim=True))).to(x.dtype)
    if weight is None:
        return dx, None
    dweight = (dy32 * _normalize(x32, rstd, casting, r)).reshape(-1, x.shape[-1]).sum(0)
    return dx, dweight.to(weight.dtype)
