"""NaN safety (the Gemma-2 NaN losses): 16-bit activations whose squares overflow float16, rows of zeros, tiny
rows, and a row holding a NaN, through every implementation of both stacks.

* Without the NaN: every output finite and within the accuracy rule of the float64 reference (sums of squares
  are float32, so squares above float16's maximum are fine); ``dweight`` finite.
* With the NaN: the other rows' ``y`` and ``dx`` are bit-identical to the run without it (a NaN stays in its
  row); ``dweight`` may then be NaN (every row adds into it), and only then.

Deliberately broken variants are caught: one that squares in float16 (the overflow behind such NaN losses), one
whose dx picks up the NaN through dweight.
"""

from __future__ import annotations

import pytest
import torch

from pallas_norm_tools import parity
from torch_bridge.numpy_io import autograd_outputs

from helpers import DEVICE, judge, torch_inputs

N = 4096 if DEVICE == "cuda" else 256
LARGE = {torch.float16: 3e3, torch.bfloat16: 1e15}  # float16: squares ~1e7 > 65504; bf16: squares ~1e30
NAN_ROW = 4


def rows(dtype: torch.dtype, with_nan: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x rows: normal, large, zeros, tiny, normal (NaN at one element when ``with_nan``), normal; w; dy."""
    x, w, dy = torch_inputs((6, N), torch.float32, 0.0, seed=7)
    x[1] *= LARGE[dtype]
    x[2] = 0.0
    x[3] *= 1e-3
    if with_nan:
        x[NAN_ROW, N // 3] = float("nan")
    return x.to(dtype), w.to(dtype), dy.to(dtype)


def float16_squares(x, w, dy, case):
    """Deliberately naive: ``mean(x²)`` in x's dtype, which overflows float16 (test-only)."""
    def fn(a, b):
        return a * torch.rsqrt((a * a).mean(-1, keepdim=True) + case.eps) * (b + case.offset)
    return autograd_outputs(fn, x, w, dy)


def dweight_leaks_into_dx(x, w, dy, case):
    """Deliberately broken: ``dx + 0·dweight``, so one row's NaN (in every column of dweight) reaches all rows."""
    y, dx, dw = parity.bridge("pallas_dlpack")(x, w, dy, case)
    return y, dx + 0 * dw, dw


def nan_safety_failures(impl: parity.Impl, dtype: torch.dtype, casting: str) -> list[str]:
    offset = 1.0 if casting == "gemma" else 0.0
    case = parity.Case(casting, offset, str(dtype).removeprefix("torch."), (6, N))
    x, w, dy = rows(dtype, with_nan=False)
    clean = impl(x, w, dy, case)
    failures = judge(x, w, dy, clean, rounding_points=False, **case.mode)
    xn, _, _ = rows(dtype, with_nan=True)
    poisoned = impl(xn, w, dy, case)
    keep = torch.arange(6, device=x.device) != NAN_ROW
    for name, a, b in zip(("y", "dx"), poisoned, clean):
        if not torch.equal(a[keep].float().nan_to_num(7.0), b[keep].float().nan_to_num(7.0)):
            failures.append(f"{name}: rows without the NaN changed when one row got a NaN")
    return [f for f in failures if f]


@pytest.mark.parametrize("casting", ["llama", "gemma", "none"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("impl", list(parity.implementations(DEVICE)))
def test_large_zero_and_nan_rows(impl, dtype, casting):
    assert nan_safety_failures(parity.implementations(DEVICE)[impl], dtype, casting) == []


def test_checks_catch_float16_squares_and_a_leaking_nan():
    assert any(f.startswith("y:") for f in nan_safety_failures(float16_squares, torch.float16, "gemma"))
    assert nan_safety_failures(dweight_leaks_into_dx, torch.bfloat16, "llama") == [
        "dx: rows without the NaN changed when one row got a NaN"]
