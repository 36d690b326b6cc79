"""The forward's ``y = r(n · w_eff)`` multiplied in the input dtype where both factors are values of it
(``kernels.output_in_dtype``): the same bits as the float32 product, on CPU and compiled."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_norm as pn
from pallas_norm import kernels
from pallas_norm.kernels import output_in_dtype
from pallas_norm.pallas_config import Config

from helpers import KERNEL, assert_same_bits, jax_inputs

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32


def test_the_rule():
    """llama: no offset and the weight stored in the input dtype; none: always (both factors are rounded); gemma
    (``n`` in float32) and float32 inputs: never."""
    assert output_in_dtype("llama", 0.0, BF16, BF16) and output_in_dtype("llama", 0.0, F16, F16)
    assert not output_in_dtype("llama", 1.0, BF16, BF16)  # w + 1 is not a bf16 value
    assert not output_in_dtype("llama", 0.0, F32, BF16)  # nor is a float32 weight
    assert output_in_dtype("none", 1.0, F32, BF16) and output_in_dtype("none", 0.0, BF16, F16)
    assert not output_in_dtype("gemma", 0.0, BF16, BF16)
    assert not output_in_dtype("llama", 0.0, F32, F32) and not output_in_dtype("none", 0.0, F32, F32)


def _outputs(x, r, w, monkeypatch, rule, impl, **kw):
    """``rms_norm`` and ``rms_norm_add``'s ``y`` under ``rule`` (kernels traced afresh)."""
    monkeypatch.setattr(kernels, "output_in_dtype", rule)
    jax.clear_caches()
    return pn.rms_norm(x, w, impl=impl, **kw), pn.rms_norm_add(x, r, w, impl=impl, **kw)[0]


CASES = [((37, 1000), BF16, BF16, "llama", 0.0, None), ((37, 1000), F16, F16, "llama", 0.0, None),
         ((37, 1000), BF16, F32, "none", 1.0, None), ((20, 640), F16, F16, "none", 0.0, None),
         ((37, 1000), BF16, BF16, "llama", 0.0, Config(1, 128, 1))]  # column chunks


@pytest.mark.parametrize("case", range(len(CASES)))
def test_same_bits_as_the_float32_product(case, monkeypatch):
    """Where the rule allows it, the input-dtype product gives the float32 product's bits (plain, fused add, column
    chunks). Broken variant: the rule forced for gemma (``n`` rounded to the input dtype first) and for llama with
    an offset (``w + 1`` rounded) changes them."""
    shape, dt, wdt, casting, offset, config = CASES[case]
    x, w, _ = jax_inputs(shape, dt, offset, weight_dtype=wdt, seed=case, scale=3.0)
    r = jax_inputs(shape, dt, seed=case + 10)[0]
    kw = dict(casting=casting, offset=offset, config=config)
    assert output_in_dtype(casting, offset, wdt, dt)
    low = _outputs(x, r, w, monkeypatch, output_in_dtype, "interpret", **kw)
    wide = _outputs(x, r, w, monkeypatch, lambda *a: False, "interpret", **kw)
    for a, b in zip(low, wide):
        assert_same_bits(a, b)
    if case == 0:
        for bad in (dict(casting="gemma", offset=0.0), dict(casting="llama", offset=1.0)):
            forced = _outputs(x, r, w, monkeypatch, lambda *a: True, "interpret", **bad)[0]
            right = _outputs(x, r, w, monkeypatch, lambda *a: False, "interpret", **bad)[0]
            assert not np.array_equal(np.asarray(forced, np.float32), np.asarray(right, np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,dt,casting", [(4096, 5120, BF16, "llama"), (4099, 1000, F16, "llama"),
                                            (1000, 8192, BF16, "none"), (257, 16384, F16, "llama"),
                                            (300, 2304, BF16, "llama")])
def test_gpu_same_bits_as_the_float32_product(m, n, dt, casting, monkeypatch):
    """Compiled (the GPU's native bf16/fp16 multiply; at 8192 and 16384 columns launched by jaxlib where it can):
    the input-dtype product gives the float32 product's bits, plain and fused add."""
    x, w, _ = jax_inputs((m, n), dt, seed=n, scale=3.0)
    r = jax_inputs((m, n), dt, seed=n + 1)[0]
    low = _outputs(x, r, w, monkeypatch, output_in_dtype, KERNEL, casting=casting)
    wide = _outputs(x, r, w, monkeypatch, lambda *a: False, KERNEL, casting=casting)
    for a, b in zip(low, wide):
        assert_same_bits(a, b)
