"""The accuracy rule every implementation here is held to, against a float64 reference.

flash-attention's rule: ``err(out) <= 2 · err(naive) + atol``, errors as max abs against the float64 reference
(the real-number function, no roundings). ``naive`` is the same formula evaluated plainly in float32 with the
same rounding points, so an implementation may differ from it only by float32 summation order, which ``atol``
bounds: ``4 · eps32 · (sqrt(n_reduce) + 2)`` times the magnitude of the terms summed (``dx`` and ``dweight``
cancel far below their terms, so the scale is the terms', not the result's).

Rounding points are checked separately (:func:`rounding_point_failure`): a 16-bit output must equal the naive
formula's except for rare one-ulp flips, which a casting-mode mix-up (rounding in the wrong place) fails.
"""

from __future__ import annotations

import math

import torch

EPS32 = 2.0**-23


def term_scales(x: torch.Tensor, w: torch.Tensor | None, dy: torch.Tensor, offset: float,
                eps: float = 1e-6) -> list[float]:
    """Magnitudes of the terms ``y``, ``dx`` and ``dweight`` are made of (the atol scale of each output)."""
    x64, dy64 = x.double(), dy.double()
    rstd = torch.rsqrt((x64 * x64).mean(-1, keepdim=True) + eps)
    w_eff = None if w is None else w.double() + offset
    g = dy64 if w_eff is None else dy64 * w_eff
    y = x64 * rstd if w_eff is None else x64 * rstd * w_eff
    dw_terms = (dy64 * x64 * rstd).reshape(-1, x.shape[-1])
    terms = (y, rstd * g, dw_terms.square().sum(0).sqrt())
    return [t.abs().nan_to_num(0.0, 0.0, 0.0).max().item() if t.numel() else 0.0 for t in terms]


def atol_for(n_reduce: int, scale: float) -> float:
    """float32 summation/rounding-order allowance: ``4 · eps32 · (sqrt(n_reduce) + 2) · scale``."""
    return 4 * EPS32 * (math.sqrt(n_reduce) + 2) * scale


def max_abs_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |out - ref|`` in float64 (0 for empty tensors; inf if any value is non-finite)."""
    if out.numel() == 0:
        return 0.0
    diff = (out.double() - ref.to(out.device).double()).abs()
    return math.inf if not torch.isfinite(diff).all() else diff.max().item()


def accuracy_bound(naive: torch.Tensor, ref: torch.Tensor, n_reduce: int, scale: float) -> float:
    """The largest error the rule allows: ``2 · err(naive) + atol_for(n_reduce, scale)``."""
    return 2 * max_abs_err(naive, ref) + atol_for(n_reduce, scale)


def accuracy_failure(name: str, out: torch.Tensor, naive: torch.Tensor, ref: torch.Tensor, n_reduce: int,
                     scale: float) -> str | None:
    """None if ``out`` meets the rule, else a message with its error and the bound."""
    if tuple(out.shape) != tuple(ref.shape):
        return f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    if not torch.isfinite(out).all():
        return f"{name}: non-finite values"
    err, bound = max_abs_err(out, ref), accuracy_bound(naive, ref, n_reduce, scale)
    if err <= bound:
        return None
    return f"{name}: error {err:.3e} > 2 x naive {max_abs_err(naive, ref):.3e} + atol {atol_for(n_reduce, scale):.3e}"


def assert_accurate(name: str, out: torch.Tensor, naive: torch.Tensor, ref: torch.Tensor, n_reduce: int,
                    scale: float) -> None:
    failure = accuracy_failure(name, out, naive, ref, n_reduce, scale)
    assert failure is None, failure


def rounding_point_failure(name: str, out: torch.Tensor, naive: torch.Tensor, atol: float,
                           max_fraction: float = 0.01) -> str | None:
    """16-bit outputs: ``out`` equals the naive formula except on at most ``max_fraction`` of the elements, and
    there by at most one ulp (+ ``atol`` for summation order, which matters where ``dx`` cancels)."""
    if out.numel() == 0 or out.dtype in (torch.float32, torch.float64):
        return None
    out64, naive64 = out.double(), naive.to(out.device).double()
    diff = (out64 - naive64).abs()
    fraction = (diff > atol).double().mean().item()
    if fraction > max_fraction:
        return f"{name}: {fraction:.3%} of elements differ from the naive formula (rounding points moved?)"
    ulp = torch.finfo(out.dtype).eps * naive64.abs().clamp_min(torch.finfo(out.dtype).tiny)
    if not (diff <= 2 * ulp + atol).all():
        return f"{name}: differs from the naive formula by more than one ulp + atol {atol:.3e}"
    return None


def assert_same_rounding_points(name: str, out: torch.Tensor, naive: torch.Tensor, atol: float,
                                max_fraction: float = 0.01) -> None:
    failure = rounding_point_failure(name, out, naive, atol, max_fraction)
    assert failure is None, failure
