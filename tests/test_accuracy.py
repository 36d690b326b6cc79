"""``pallas_norm.accuracy``, the one rule every suite uses: its reference is the exact function, its naive
formula keeps the modes' rounding points, its checks fail on broken outputs, and its inputs are reproducible."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from pallas_norm import accuracy
from torch_bridge.eager import rms_norm_ref_backward, rms_norm_ref_forward
from torch_bridge.numpy_io import from_numpy, to_numpy

from helpers import jax_vjp, jax_inputs

CASES = [("llama", 0.0, "bfloat16"), ("gemma", 1.0, "float16"), ("none", 0.0, "bfloat16"), ("gemma", 1.0, "float32")]


@pytest.mark.parametrize("casting,offset,dtype", CASES)
def test_reference_is_the_exact_function_and_naive_the_rounded_formula(casting, offset, dtype):
    """``exact`` equals the formulas evaluated by torch in float64 on the same values (no roundings: float64 x);
    ``naive`` keeps the torch float32 formula's rounding points."""
    x, w, dy = accuracy.make_inputs((37, 300), dtype, offset, seed=1)
    kw = dict(eps=1e-6, offset=offset, casting=casting)
    ref = accuracy.reference(x, w, dy, **kw)
    x64, w64, dy64 = (torch.from_numpy(a.astype(np.float64)) for a in (x, w, dy))
    y64, _ = rms_norm_ref_forward(x64, w64, **kw)
    dx64, dw64 = rms_norm_ref_backward(dy64, x64, w64, **kw)
    for o, want in zip(accuracy.OUTPUTS, (y64, dx64, dw64)):
        np.testing.assert_allclose(ref.exact[o], want.numpy(), rtol=1e-12, atol=1e-12 * ref.scale[o])
    xt, wt, dyt = (from_numpy(a) for a in (x, w, dy))
    naive_torch = (rms_norm_ref_forward(xt, wt, **kw)[0], *rms_norm_ref_backward(dyt, xt, wt, **kw))
    for o, t in zip(("y", "dx"), naive_torch):
        assert accuracy.rounding_point_failure(o, to_numpy(t), ref.naive[o], ref.atol(o)) is None
    assert ref.naive["y"].dtype == x.dtype and ref.naive["dweight"].dtype == w.dtype


def test_rule_catches_broken_outputs():
    x, w, dy = accuracy.make_inputs((64, 256), "bfloat16", 0.0, seed=2)
    kw = dict(eps=1e-6, offset=0.0, casting="llama")
    ref = accuracy.reference(x, w, dy, **kw)
    good = [ref.naive[o] for o in accuracy.OUTPUTS]
    assert ref.failures("naive", good) == []
    no_eps = accuracy.reference(x, w, dy, eps=1.0, offset=0.0, casting="llama").naive  # eps moved: rstd wrong
    assert any("error" in f for f in ref.failures("eps", [no_eps[o] for o in accuracy.OUTPUTS]))
    gemma = accuracy.reference(x, w, dy, eps=1e-6, offset=0.0, casting="gemma").naive  # one rounding, not two
    assert any("vs naive" in f for f in ref.failures("mixup", [gemma[o] for o in accuracy.OUTPUTS]))
    two_ulps = good[0].astype(np.float32) * np.float32(1 + 2**-6)
    assert any(f.startswith("bumped y") for f in ref.failures("bumped", [two_ulps.astype(x.dtype), *good[1:]]))
    nan_dw = good[2].copy()
    nan_dw[3] = np.nan
    assert ref.failures("nan", [*good[:2], nan_dw]) == ["nan dweight: non-finite values"]
    assert ref.failures("f32", [good[0].astype(np.float32), *good[1:]])[0].startswith("f32 y: float32")


def test_ties_decided_by_float32_order_are_not_rounding_point_moves():
    """N = 1 with Gemma's ``1 + w``: every row's ``y`` is ``±(1 + w)·(1 − δ)``, δ a few float32 ulps. A float16 weight
    whose ``1 + w`` sits exactly on a float16 tie makes each row's rounding a coin toss of float32 evaluation
    order; the rule does not count those, and counted them they would fail the kernel."""
    x, w, dy = jax_inputs((129, 1), "float16", 1.0, seed=15)
    w_eff = 1 + float(w[0])  # 1.10498046875: midway between the float16 neighbours 1.1045 and 1.105
    assert (w_eff - 1) * 2**10 % 1 == 0.5
    kw = dict(eps=1e-6, offset=1.0, casting="gemma")
    y, dx, dw = (np.asarray(a) for a in jax_vjp("interpret", x, w, dy, **kw))
    ref = accuracy.reference(*(np.asarray(a) for a in (x, w, dy)), **kw)
    assert ref.failures("interpret", (y, dx, dw)) == []
    assert accuracy.rounding_point_failure("y", y, ref.naive["y"], ref.atol("y")) is not None  # not excused


def none_casting_y(x, w, eps, nudge_ulps: int):
    """Casting "none"'s ``y`` in float32 with rstd moved by ``nudge_ulps`` float32 ulps, as another summation
    order or an approximate rsqrt gives it (docs/semantics.md)."""
    f32, r = np.float32, (lambda v: v.astype(x.dtype).astype(np.float32))
    x32 = x.astype(f32)
    rstd = f32(1) / np.sqrt(np.mean(x32 * x32, axis=-1, keepdims=True) + f32(eps))
    rstd = rstd * f32(1 + nudge_ulps * 2.0**-23)
    return (r(x32 * r(rstd)) * r(r(w.astype(f32)) + f32(1.0))).astype(x.dtype)


def test_rows_whose_rounded_rstd_sits_at_a_tie_are_not_rounding_point_moves():
    """Casting "none" rounds rstd itself to x's dtype: an rstd 100 float32 ulps off (within summation noise for
    N = 2304) flips that rounding in a few percent of the rows and moves each such row's ``y`` by an ulp or two.
    Those rows are excused; counted, they fail; an rstd far off is still caught."""
    x, w, _ = accuracy.make_inputs((512, 2304), "float16", 1.0, seed=7)
    ref = accuracy.reference(x, w, np.ones_like(x), eps=1e-6, offset=1.0, casting="none")
    y = none_casting_y(x, w, 1e-6, 100)
    assert 0 < np.count_nonzero((y != ref.naive["y"]).any(axis=1)) <= np.count_nonzero(ref.tie_rows)
    assert ref.failures("nudged", {"y": y}, only=("y",), bounded=False) == []
    assert accuracy.rounding_point_failure("y", y, ref.naive["y"], ref.atol("y"), ref.unrounded["y"]) is not None
    far = none_casting_y(x, w, 1e-6, 4096)  # rstd off by 2^-11 relative: a real error, in most rows
    assert ref.failures("far", {"y": far}, only=("y",), bounded=False) != []


def test_make_inputs_reproducible_and_around_the_init():
    a = accuracy.make_inputs((3, 70000), "bfloat16", 1.0, seed=4)  # several row blocks
    b = accuracy.make_inputs((3, 70000), "bfloat16", 1.0, seed=4)
    c = accuracy.make_inputs((3, 70000), "bfloat16", 1.0, seed=5)
    assert all(accuracy.same_bits(u, v) for u, v in zip(a, b)) and not accuracy.same_bits(a[0], c[0])
    x, w, dy = a
    assert x.dtype == np.dtype(ml_dtypes.bfloat16) and abs(float(w.astype(np.float32).mean())) < 0.01
    assert 0.9 < float(accuracy.make_inputs((4, 4096), "float32", 0.0)[1].mean()) < 1.1
    assert not np.any(x.astype(np.float32) == 0) and not accuracy.same_bits(x, dy)


def test_row_blocks_on_threads_give_the_single_block_answer(monkeypatch):
    x, w, dy = accuracy.make_inputs((50, 1000), "float16", 0.0, seed=6)
    kw = dict(eps=1e-6, offset=0.0, casting="none")
    whole = accuracy.reference(x, w, dy, **kw)
    monkeypatch.setattr(accuracy, "_BLOCK_ELEMS", 3000)  # 3 rows per block, 17 blocks
    blocks = accuracy.reference(x, w, dy, **kw)
    for o in ("y", "dx"):
        assert accuracy.same_bits(whole.naive[o], blocks.naive[o]) and accuracy.same_bits(whole.exact[o],
                                                                                            blocks.exact[o])
    np.testing.assert_allclose(blocks.exact["dweight"], whole.exact["dweight"], rtol=1e-12)
    assert all(abs(blocks.bound(o) - whole.bound(o)) <= 1e-3 * whole.bound(o) for o in accuracy.OUTPUTS)
