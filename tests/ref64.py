"""Float64 NumPy reference of ``docs/semantics.md`` (forward and backward), and the tolerance rule.

Independent of both stacks' code. Roundings to the input dtype happen exactly where the casting mode puts them.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

F64 = np.float64
EPS = {"float32": 2.0**-23, "bfloat16": 2.0**-7, "float16": 2.0**-10}


def _r(v: np.ndarray, dt) -> np.ndarray:
    return np.asarray(v, F64).astype(dt).astype(F64)


def forward(x, w, *, eps, offset, casting):
    """``(y, rstd)`` in float64 (``y`` rounded to x's dtype as the mode says, returned widened)."""
    dt = x.dtype
    x64 = np.asarray(x, F64)
    rstd = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    n = {"llama": lambda: _r(x64 * rstd, dt), "gemma": lambda: x64 * rstd,
         "none": lambda: _r(x64 * _r(rstd, dt), dt)}[casting]()
    w_eff = None if w is None else w_effective(w, offset, casting, dt)
    return _r(n if w_eff is None else n * w_eff, dt), rstd[..., 0]


def w_effective(w, offset, casting, dt):
    w64 = np.asarray(w, F64)
    return _r(_r(w64, dt) + offset, dt) if casting == "none" else w64 + offset


def backward(x, w, dy, *, eps, offset, casting):
    """``(dx, dweight)`` in float64 from the semantics' formulas (rstd recomputed in float64)."""
    dt = x.dtype
    x64, dy64 = np.asarray(x, F64), np.asarray(dy, F64)
    rstd = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    w_eff = 1.0 if w is None else w_effective(w, offset, casting, dt)
    g = dy64 * w_eff
    if casting != "gemma":
        g = _r(g, dt)
    dx = rstd * (g - x64 * rstd**2 * np.mean(g * x64, axis=-1, keepdims=True))
    if w is None:
        return dx, None
    n = {"llama": lambda: _r(x64 * rstd, dt), "gemma": lambda: x64 * rstd,
         "none": lambda: _r(x64 * _r(rstd, dt), dt)}[casting]()
    dweight = (dy64 * n).reshape(-1, x.shape[-1]).sum(axis=0)
    return dx, dweight


def to64(a) -> np.ndarray:
    return np.asarray(np.asarray(a).astype(np.float32), F64)


def max_err(a, ref) -> float:
    a, ref = to64(a), np.asarray(ref, F64)
    return float(np.max(np.abs(a - ref), initial=0.0))


def assert_close(name, actual, naive, ref, *, dtype, n_reduce: int):
    """flash-attention's rule: ``err(actual) <= 2·err(naive) + atol`` against the float64 ``ref``.

    ``naive`` is the same formula in float32 through XLA (same roundings, another summation order), so the
    kernel may differ from it only by reduction-order effects. ``atol`` = one ulp of ``dtype`` at the output's
    scale plus float32 summation error growing with √n_reduce.
    """
    dtype = np.dtype(dtype).name
    scale = float(np.max(np.abs(ref), initial=0.0)) or 1.0
    atol = scale * (EPS[dtype] + 4 * math.sqrt(max(n_reduce, 1)) * EPS["float32"])
    err, err_naive = max_err(actual, ref), max_err(naive, ref)
    assert np.all(np.isfinite(to64(actual))), f"{name}: non-finite values"
    assert err <= 2 * err_naive + atol, (
        f"{name}: max error {err:.3e} > 2 × naive {err_naive:.3e} + atol {atol:.3e} (scale {scale:.3e})")


bfloat16 = ml_dtypes.bfloat16
