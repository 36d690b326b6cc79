"""Where ``impl=None``'s forward of 16-bit rows with the weight's product in float32 (Gemma's casting) runs on Mosaic
GPU (``auto.MOSAIC_FWD_F32_BY_MODEL``): which calls take it, that the forward hands the lowering its rows and the
product, and on an H200 that it runs there with the fused add's y ``rms_norm(h)``'s bits."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_norm as pn
from pallas_norm import auto, backend

from helpers import bits, hopper, jax_inputs

CASES = [(4096, 1152), (32768, 1152), (4096, 1536), (8192, 2048), (4096, 2304), (16384, 2304), (8192, 2560),
         (8192, 3072), (32768, 4608)]  # below each width's rows per SM on 132 SMs
ABOVE = [(8192, 1536), (16384, 2048), (32768, 2304), (32768, 2560), (16384, 3072)]  # from them: the Triton lowering


def _h200(monkeypatch) -> None:
    monkeypatch.setattr(backend, "gpu_model", lambda: "h200")
    monkeypatch.setattr(backend, "num_sms", lambda: 132)
    monkeypatch.setattr(backend, "mosaic_capable", lambda: True)


def _forward(m: int, n: int, *, f32: bool = True, itemsize: int = 2) -> str:
    return auto.lowering(False, n, m=m, itemsize=itemsize, float32_product=f32)


def test_h200_forward_with_the_float32_product_takes_mosaic_gpu_below_its_rows(monkeypatch):
    """On an H200: 16-bit rows of the table's widths with a float32 product, below its rows per SM (1152 and 4608 at
    every row count). Not Llama's product in the row's dtype (or none), float32 rows, unnamed widths (3584, 5376) or
    the H100; the backward keeps its rule. Broken variant: the table emptied (the H100's rule) takes the Triton
    lowering."""
    _h200(monkeypatch)
    assert [_forward(m, n) for m, n in CASES] == ["mosaic"] * len(CASES)
    assert [_forward(m, n) for m, n in ABOVE] == ["pallas"] * len(ABOVE)
    assert [_forward(4096, 2304, f32=False), _forward(4096, 2304, itemsize=4), _forward(4096, 3584),
            _forward(4096, 5376), _forward(4096, 2304, itemsize=None)] == ["pallas"] * 5
    assert _forward(10**6, 1152) == _forward(10**6, 4608) == "mosaic"
    assert auto.lowering(True, 2304, m=4096, itemsize=2) == "pallas"  # auto.TRITON_BWD_PIECES
    monkeypatch.setattr(backend, "gpu_model", lambda: "")  # the H100
    assert [_forward(m, n) for m, n in CASES] == ["pallas"] * len(CASES)
    monkeypatch.setattr(backend, "gpu_model", lambda: "h200")
    monkeypatch.setattr(auto, "MOSAIC_FWD_F32_BY_MODEL", {})  # the broken variant
    assert [_forward(m, n) for m, n in CASES] == ["pallas"] * len(CASES)


@pytest.mark.parametrize("casting,offset,weight_dtype,weighted,f32", [
    ("gemma", 1.0, None, True, True), ("llama", 0.0, None, True, False), ("llama", 0.0, jnp.float32, True, True),
    ("gemma", 0.0, None, False, False)])
def test_forward_hands_the_lowering_its_rows_and_product(monkeypatch, casting, offset, weight_dtype, weighted, f32):
    """``impl=None``'s forward, plain and fused add alike, asks ``auto.lowering`` with its rows and whether a weight's
    product is taken in float32 (not ``kernels.product_in_dtype``: Gemma's casting, or a float32 weight; without a
    weight there is none). Broken variant: the flag flipped is not what was asked."""
    seen = []
    monkeypatch.setattr(backend, "on_gpu", lambda: True)
    record = lambda backward, n, config=None, **kw: seen.append((backward, n, kw)) or "xla"  # noqa: E731
    monkeypatch.setattr(auto, "lowering", record)
    x, w, _ = jax_inputs((6, 384), jnp.bfloat16, offset, weight_dtype=weight_dtype, seed=3)
    w = w if weighted else None
    pn.rms_norm(x, w, offset=offset, casting=casting)
    pn.rms_norm_add(x, x, w, offset=offset, casting=casting)
    want = dict(m=6, itemsize=2, float32_product=f32)
    assert seen == [(False, 384, want)] * 2
    assert seen[0] != (False, 384, {**want, "float32_product": not f32})


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("m,n,casting,weight_dtype", [(4096, 2304, "gemma", None), (8192, 2048, "gemma", None),
                                                      (8192, 1152, "gemma", None), (4096, 4608, "gemma", None),
                                                      (4096, 3072, "llama", jnp.float32)])
def test_gpu_h200_float32_product_forward_on_mosaic_keeps_the_fused_add_s_bits(m, n, casting, weight_dtype):
    """On an H200 (skipped elsewhere): the forward of these shapes with a float32 product (Gemma's; Llama's with a
    float32 weight) is Mosaic GPU's (``impl="mosaic"``'s bits, which the Triton lowering's are not: the check can
    fail), and the fused add's y and rstd are ``rms_norm(h)``'s bits. Broken variant: the fused add on the Triton
    lowering, whose y differs from the plain forward's."""
    if backend.gpu_model() != "h200":
        pytest.skip("auto.MOSAIC_FWD_F32_BY_MODEL names the H200 only")
    from pallas_norm import api

    offset = 1.0 if casting == "gemma" else 0.0
    x, w, _ = jax_inputs((m, n), jnp.bfloat16, offset, weight_dtype=weight_dtype, seed=31)
    r = jax_inputs((m, n), jnp.bfloat16, seed=32)[0]
    kw = dict(offset=offset, casting=casting)
    y = pn.rms_norm(x, w, **kw)
    np.testing.assert_array_equal(bits(y), bits(pn.rms_norm(x, w, impl="mosaic", **kw)))
    assert not np.array_equal(bits(y), bits(pn.rms_norm(x, w, impl="pallas", **kw)))
    y, h, rstd = api.forward_fn(1e-6, offset, casting, "auto", None, jnp.bfloat16)(x, r, w)
    y_h, rstd_h = api.forward_fn(1e-6, offset, casting, "auto")(h, w)
    np.testing.assert_array_equal(bits(y), bits(y_h))
    np.testing.assert_array_equal(bits(rstd), bits(rstd_h))
    y_pallas = api.forward_fn(1e-6, offset, casting, "pallas", None, jnp.bfloat16)(x, r, w)[0]
    assert not np.array_equal(bits(y_pallas), bits(y_h))
