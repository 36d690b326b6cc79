"""RMSNorm's row math, written once (``docs/semantics.md``) for every array library that evaluates it.

The Pallas kernel bodies and the XLA path (JAX), the accuracy module's float64 reference and naive float32
formula (NumPy) and the plain-torch formula (torch) all call these functions. They use arithmetic only, so any
array type works; what differs between callers is passed in: ``r`` rounds a value of the compute dtype to the
input dtype and widens it back (the identity where nothing is rounded: float32 inputs, or the exact reference),
``rsqrt`` is the library's reciprocal square root. Inputs arrive already widened to the compute dtype;
``w_eff=None`` means no weight. The order of operations is the kernels' (it decides their bits).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

A = TypeVar("A")  # an array of any library (jax.Array, np.ndarray, torch.Tensor)
Rounder = Callable[[A], A]


def rstd_from_sumsq(sumsq: A, n: int, eps: float, rsqrt: Callable[[A], A]) -> A:
    """``rstd = rsqrt(sum(x²) / N + eps)``."""
    return rsqrt(sumsq / n + eps)


def effective_weight(w: A, offset: float, casting: str, r: Rounder) -> A:
    """``w_eff = w + offset``; for ``"none"`` ``r(r(w) + offset)`` (weight math in the input dtype)."""
    if casting == "none":
        return r(r(w) + offset)
    return w + offset


def normalized(x: A, rstd: A, casting: str, r: Rounder) -> A:
    """The normalised value ``n``: llama ``r(x·rstd)``; gemma ``x·rstd``; none ``r(x·r(rstd))``."""
    if casting == "llama":
        return r(x * rstd)
    if casting == "gemma":
        return x * rstd
    return r(x * r(rstd))


def output(n: A, w_eff: A | None) -> A:
    """``n · w_eff`` (``n`` without a weight), before the final rounding to the input dtype."""
    return n if w_eff is None else n * w_eff


def output_in_dtype(casting: str, offset: float, weight_in_dtype: bool, low_precision: bool) -> bool:
    """Whether ``output``'s ``n · w_eff`` may be multiplied in the input dtype (``low_precision``: bf16/fp16) and
    rounded once, with the float32 product's bits: both factors are values of that dtype (llama: ``n = r(x·rstd)`` and
    ``w_eff = w``, so no offset and the weight stored in the input dtype, ``weight_in_dtype``; none: ``n`` and
    ``w_eff`` both rounded), and the exact product of two such values fits in float32. Gemma's ``n`` is float32:
    never. Both stacks' forwards ask this (on the GPU the multiply is then one bf16x2/f16x2 instruction per pair)."""
    if not low_precision or casting == "gemma":
        return False
    return casting == "none" or (offset == 0.0 and weight_in_dtype)


def grad_scale(dy: A, w_eff: A | None, casting: str, r: Rounder) -> A:
    """``g = dy·w_eff``: unrounded for gemma, ``r(dy·w_eff)`` for llama and none (as HF autograd does)."""
    g = dy if w_eff is None else dy * w_eff
    return g if casting == "gemma" else r(g)


def grad_input(x: A, g: A, rstd: A, sum_gx: A, n: int, mul_add: Callable[[A, A, A], A] | None = None) -> A:
    """``dx = rstd·(g − x·rstd²·mean(g·x))`` with ``sum_gx = Σ g·x`` per row (the caller rounds the result);
    ``mul_add(−x, rstd²·mean, g)`` forms the difference where given (a fused multiply-add: one rounding)."""
    c = rstd * rstd * (sum_gx / n)
    return rstd * (g - x * c if mul_add is None else mul_add(-x, c, g))


def dweight_terms(dy: A, n_value: A) -> A:
    """Per-element contribution to ``dweight = Σ_rows dy·n``."""
    return dy * n_value


def residual_add(x: A, residual: A, r_h: Rounder) -> A:
    """The fused add ``h = r_h(x + residual)``: one rounding, to the residual stream's dtype (``r_h``)."""
    return r_h(x + residual)


def grad_residual(dx_norm: A, dh_out: A) -> A:
    """``dh = dx_norm + dh_out``: the norm's input gradient plus ``h``'s own cotangent, before one rounding (the
    fused add's ``dx`` and ``dresidual`` are both ``dh``)."""
    return dx_norm + dh_out
