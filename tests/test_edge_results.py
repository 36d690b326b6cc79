"""Defined results at the edges, for both stacks (each case through every implementation of the parity matrix).

* Shapes: M = 0 (empty outputs, a zero ``dweight`` of the weight's dtype), N = 1, N = 262144, 3-D and 4-D ``x``:
  every implementation meets the float64-reference rule, bridge ≡ JAX bit for bit.
* Layouts: non-contiguous torch ``x`` (transposed, column-strided, stride-0 expanded, a storage offset) and
  negatively-strided numpy ``x`` for JAX give the bits of the contiguous copy; nothing is written.
* A float32 weight with 16-bit ``x`` (docs/semantics.md, Dtypes): ``y``/``dx`` have ``x``'s dtype, ``dweight``
  the weight's; the weight is widened to float32, never rounded to ``x``'s dtype.
* ±Inf in a row stays in that row: the other rows' ``y`` and ``dx`` are bit-identical to a run without it
  (NaN rows: ``test_nan_safety.py``).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import pallas_norm as pn
from pallas_norm_tools import parity
from torch_bridge import rms_norm

from helpers import DEFAULT_KERNEL, DEVICE, KERNEL, torch_inputs, torch_results

EDGES = [
    parity.Case("llama", 0.0, "bfloat16", (0, 16)),
    parity.Case("gemma", 1.0, "float32", (2, 0, 16)),
    parity.Case("none", 0.0, "float16", (5, 1)),
    parity.Case("llama", 0.0, "float32", (1, 1)),
    parity.Case("gemma", 1.0, "bfloat16", (2, 3, 4, 64)),
    parity.Case("llama", 0.0, "bfloat16", (2, 262144)),
]
BACKENDS = ["pallas", "triton"] + (["pallas_launch"] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("case", EDGES, ids=lambda c: c.name)
def test_edge_shapes_through_every_implementation(case):
    result = parity.run_case(case, DEVICE)
    assert result.passed, "\n".join(result.failures)
    if 0 in case.shape:
        for name, impl in parity.implementations(DEVICE).items():
            x, w, dy = torch_inputs(case.shape, case.torch_dtype, case.offset)
            y, dx, dw = impl(x, w, dy, case)
            assert y.shape == dx.shape == x.shape and dw.dtype == w.dtype, name
            assert torch.equal(dw, torch.zeros_like(w)), name


LAYOUTS = {
    "transposed": lambda t: t.t().contiguous().t(),
    "column-strided": lambda t: torch.repeat_interleave(t, 2, dim=-1)[:, ::2],
    "stride-0 rows": lambda t: t[:1].expand(t.shape[0], -1),
    "storage offset": lambda t: torch.cat([t.new_zeros(1, t.shape[1]), t])[1:],
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_non_contiguous_torch_inputs_give_the_contiguous_bits(layout, backend):
    x, w, dy = torch_inputs((6, 96), torch.bfloat16, 1.0, seed=3)
    kw = dict(offset=1.0, casting="gemma", backend=backend)
    x_view = LAYOUTS[layout](x.detach().requires_grad_())  # the view itself reaches the bridge (a clone would not)
    w = w.detach().requires_grad_()
    assert not x_view.is_contiguous() or x_view.storage_offset() > 0
    kept = x_view.detach().clone()
    y = rms_norm(x_view, w, 1e-6, **kw)
    got = (y, *torch.autograd.grad(y, (x_view, w), dy))
    want = torch_results(x_view.detach().contiguous(), w.detach(), dy, **kw)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(x_view, kept)


def test_negatively_strided_numpy_input_to_jax():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 160)).astype(np.float32)[::-1, ::-1]
    w = rng.standard_normal(160).astype(np.float32)[::-1]
    assert x.strides[0] < 0 and w.strides[0] < 0
    got = pn.rms_norm(x, w, impl=KERNEL)
    want = pn.rms_norm(jnp.asarray(x.copy()), jnp.asarray(w.copy()), impl=KERNEL)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("casting,offset", [("llama", 0.0), ("gemma", 1.0), ("none", 0.0)])
def test_float32_weight_with_16bit_x(dtype, casting, offset):
    case = parity.Case(casting, offset, dtype, (7, 1000))
    x, w, dy = torch_inputs(case.shape, case.torch_dtype, offset, weight_dtype=torch.float32, seed=5)
    rounded_w = w.to(case.torch_dtype).float()
    assert not torch.equal(rounded_w, w)  # the weight really carries bits x's dtype cannot hold
    outs = {name: impl(x, w, dy, case) for name, impl in parity.implementations(DEVICE).items()}
    for name, (y, dx, dw) in outs.items():
        assert (y.dtype, dx.dtype, dw.dtype) == (x.dtype, x.dtype, torch.float32), name
    assert all(torch.equal(a, b) for a, b in zip(outs[DEFAULT_KERNEL], outs["pallas_dlpack"]))
    if casting != "none":  # "none" rounds the weight to x's dtype by definition
        y_rounded_weight = parity.bridge("pallas_dlpack")(x, rounded_w, dy, case)[0]
        assert not torch.equal(outs["pallas_dlpack"][0], y_rounded_weight)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # Triton's interpreter: inf·0
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("value", [float("inf"), float("-inf")])
def test_inf_stays_in_its_row(value, backend):
    x, w, dy = torch_inputs((5, 300), torch.float16, 0.0, seed=6)
    poisoned = x.clone()
    poisoned[2, 17] = value
    clean, bad = (torch_results(t, w, dy, backend=backend, casting="llama") for t in (x, poisoned))
    rows = [0, 1, 3, 4]
    for a, b in zip(clean[:2], bad[:2]):
        assert torch.equal(a[rows], b[rows])
        assert torch.isfinite(a).all()
    assert not torch.isfinite(bad[0][2]).all()  # the Inf's own row is not silently "fixed"
