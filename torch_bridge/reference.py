"""Plain-torch RMSNorm following ``docs/semantics.md``: the naive formula and the high-precision reference.

``compute_dtype`` plays the role of ``f32(.)`` in the semantics. ``keep_roundings`` decides whether the
casting mode's rounding points ``r(.)`` (round trips through ``x.dtype``) are applied:

* ``compute_dtype=torch.float32`` (roundings kept by default): the *naive formula*, exactly the rounding
  points of ``docs/semantics.md``; the result has dtype ``x.dtype``. This is also the CPU fallback.
* ``compute_dtype=torch.float64`` (roundings skipped by default): the *high-precision reference*, the
  real-number function every casting mode approximates, returned in float64 without any rounding. Tests bound
  a kernel's error against it by 2x the error of the naive float32 formula (which has the same rounding points
  as the kernel) -- the flash-attention rule. ``keep_roundings=True`` applies the r(.) points in float64
  too (float64 -> float16/bfloat16 casts in torch may round twice; use it for inspection only).

For float64 ``x`` every r(.) is the identity.
"""

from __future__ import annotations

import torch

from pallas_norm.semantics import check_scalars


def _resolve(compute_dtype: torch.dtype, keep_roundings: bool | None) -> tuple[torch.dtype, bool]:
    """Roundings are kept by default for every compute dtype except float64."""
    keep = compute_dtype != torch.float64 if keep_roundings is None else keep_roundings
    return compute_dtype, keep


def _rounder(dt: torch.dtype, keep: bool):
    """r(v): round v to dt and widen back (or the identity)."""
    return (lambda v: v.to(dt).to(v.dtype)) if keep else (lambda v: v)


def _w_eff(weight: torch.Tensor | None, offset: float, casting: str, dt: torch.dtype, cdt: torch.dtype, r):
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
                         offset: float = 0.0, casting: str = "llama", compute_dtype: torch.dtype = torch.float64,
                         keep_roundings: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (y, rstd): rstd = rsqrt(mean(x*x) + eps) per row (shape x.shape[:-1]), y = r(n * w_eff).

    y has dtype x.dtype when roundings are kept, else compute_dtype; rstd has compute_dtype.
    """
    eps, offset, casting = check_scalars(eps, offset, casting, has_weight=weight is not None)
    cdt, keep = _resolve(compute_dtype, keep_roundings)
    r = _rounder(x.dtype, keep)
    x32 = x.to(cdt)
    rstd = torch.rsqrt((x32 * x32).mean(-1, keepdim=True) + eps)
    n = _normalize(x32, rstd, casting, r)
    w_eff = _w_eff(weight, offset, casting, x.dtype, cdt, r)
    y = n if w_eff is None else n * w_eff
    return (y.to(x.dtype) if keep else y), rstd.squeeze(-1)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6, *, offset: float = 0.0,
                 casting: str = "llama", compute_dtype: torch.dtype = torch.float64,
                 keep_roundings: bool | None = None) -> torch.Tensor:
    """RMSNorm by the formulas of docs/semantics.md; see the module docstring for the two modes.

    Differentiable by autograd; use :func:`rms_norm_ref_backward` for the backward *as specified* (its
    rounding points differ from what autograd through the rounded forward would do).
    """
    return rms_norm_ref_forward(x, weight, eps, offset=offset, casting=casting, compute_dtype=compute_dtype,
                                keep_roundings=keep_roundings)[0]


def rms_norm_ref_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6, *,
                          offset: float = 0.0, casting: str = "llama", compute_dtype: torch.dtype = torch.float64,
                          keep_roundings: bool | None = None, rstd: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (dx, dweight) by the backward of docs/semantics.md:

        g  = dy * w_eff (r(.) for llama/none), dx = r(rstd * (g - x * rstd^2 * mean(g * x)))
        dweight = sum over rows of dy * n, in compute_dtype, returned in weight.dtype (None without weight)

    ``rstd`` (shape x.shape[:-1]) is recomputed from x when not given. With roundings skipped, dx and
    dweight are returned in compute_dtype.
    """
    eps, offset, casting = check_scalars(eps, offset, casting, has_weight=weight is not None)
    cdt, keep = _resolve(compute_dtype, keep_roundings)
    r = _rounder(x.dtype, keep)
    x32 = x.to(cdt)
    if rstd is None:
        rstd = torch.rsqrt((x32 * x32).mean(-1) + eps)
    rstd = rstd.to(cdt).unsqueeze(-1)
    dy32 = dy.to(cdt)
    w_eff = _w_eff(weight, offset, casting, x.dtype, cdt, r)
    if w_eff is None:
        g = dy32
    else:
        g = dy32 * w_eff
        g = g if casting == "gemma" else r(g)
    dx = rstd * (g - x32 * (rstd * rstd) * (g * x32).mean(-1, keepdim=True))
    dx = dx.to(x.dtype) if keep else dx
    if weight is None:
        return dx, None
    dweight = (dy32 * _normalize(x32, rstd, casting, r)).reshape(-1, x.shape[-1]).sum(0)
    return dx, (dweight.to(weight.dtype) if keep else dweight)


def rms_norm_ref_outputs(x: torch.Tensor, weight: torch.Tensor | None, dy: torch.Tensor, eps: float = 1e-6, *,
                         offset: float = 0.0, casting: str = "llama", compute_dtype: torch.dtype = torch.float64
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(y, dx, dweight)`` by the forward and the specified backward above, in one call."""
    kw = dict(offset=offset, casting=casting, compute_dtype=compute_dtype)
    return (rms_norm_ref(x, weight, eps, **kw), *rms_norm_ref_backward(dy, x, weight, eps, **kw))
