"""The forward's ``y = r(n · w_eff)`` multiplied in the input dtype where both factors are values of it
(``rowmath.output_in_dtype``, both stacks), and the Pallas backward's ``g = r(dy · w_eff)`` likewise
(``tiles.grad_in_dtype``): the same bits as the float32 product, on CPU and compiled."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import pallas_norm as pn
from pallas_norm import kernels, pallas_config, rowmath, tiles
from pallas_norm.pallas_config import Config
from pallas_norm.rowmath import output_in_dtype

from helpers import DEVICE, KERNEL, assert_same_bits, jax_inputs, kernel_jaxpr, torch_inputs

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32


def test_the_rule():
    """llama: no offset and the weight stored in the input dtype; none: always (both factors are rounded); gemma
    (``n`` in float32) and float32 inputs: never. Arguments: casting, offset, weight in the input dtype, the input
    dtype bf16/fp16."""
    assert output_in_dtype("llama", 0.0, True, True)
    assert not output_in_dtype("llama", 1.0, True, True)  # w + 1 is not a bf16 value
    assert not output_in_dtype("llama", 0.0, False, True)  # nor is a float32 weight
    assert output_in_dtype("none", 1.0, False, True) and output_in_dtype("none", 0.0, True, True)
    assert not output_in_dtype("gemma", 0.0, True, True)
    assert not output_in_dtype("llama", 0.0, True, False) and not output_in_dtype("none", 0.0, True, False)


def _outputs(x, r, w, monkeypatch, rule, impl, **kw):
    """``rms_norm`` and ``rms_norm_add``'s ``y`` under ``rule`` (kernels traced afresh)."""
    monkeypatch.setattr(rowmath, "output_in_dtype", rule)
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
    assert output_in_dtype(casting, offset, wdt == dt, True)
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
    """Compiled (the GPU's native bf16/fp16 multiply; at 5120, 8192 and 16384 columns launched by jaxlib where it can):
    the input-dtype product gives the float32 product's bits, plain and fused add, on the heuristic's tile (pinned:
    the rule also picks ``FWD_FFI_TWO_PASS``' warps)."""
    x, w, _ = jax_inputs((m, n), dt, seed=n, scale=3.0)
    r = jax_inputs((m, n), dt, seed=n + 1)[0]
    config = pallas_config.heuristic(m, n, backward=False)
    low = _outputs(x, r, w, monkeypatch, output_in_dtype, KERNEL, casting=casting, config=config)
    wide = _outputs(x, r, w, monkeypatch, lambda *a: False, KERNEL, casting=casting, config=config)
    for a, b in zip(low, wide):
        assert_same_bits(a, b)


def _grads(x, w, dy, monkeypatch, dtypes, impl, grad_rule=None, **kw):
    """``rms_norm``'s ``(dx, dweight)`` with g multiplied in the row dtype for ``dtypes`` (``tiles.BWD_LOW_DTYPES``;
    ``grad_rule`` replaces ``grad_in_dtype``), kernels traced afresh."""
    monkeypatch.setattr(tiles, "BWD_LOW_DTYPES", dtypes)
    monkeypatch.setattr(kernels, "grad_in_dtype", grad_rule or tiles.grad_in_dtype)
    jax.clear_caches()
    return jax.vjp(lambda a, b: pn.rms_norm(a, b, impl=impl, **kw), x, w)[1](dy)


BWD_CASES = [((37, 1000), BF16, BF16, "llama", 0.0, None), ((37, 1000), F16, F16, "llama", 0.0, None),
             ((20, 640), BF16, F32, "none", 1.0, None), ((9, 2304), BF16, BF16, "llama", 0.0, None),  # pieces
             ((37, 1000), F16, F16, "llama", 0.0, Config(1, 128, 1))]  # column chunks


@pytest.mark.parametrize("case", range(len(BWD_CASES)))
def test_backward_same_bits_as_the_float32_product(case, monkeypatch):
    """The backward's g = r(dy·w_eff) as one multiply in the row dtype (round_to keeps its rounding under XLA's
    excess precision): the float32 product's dx and dweight bits (resident rows, pieces, column chunks). Broken
    variant: the multiply forced for gemma (``w + 1`` rounded, g rounded) changes dx."""
    shape, dt, wdt, casting, offset, config = BWD_CASES[case]
    x, w, dy = jax_inputs(shape, dt, offset, weight_dtype=wdt, seed=case, scale=3.0)
    kw = dict(casting=casting, offset=offset, bwd_config=config)
    assert tiles.grad_in_dtype(wdt, dt, casting, offset) and not tiles.grad_in_dtype(wdt, dt, casting, offset, True)
    low = _grads(x, w, dy, monkeypatch, ("bfloat16", "float16"), "interpret", **kw)
    wide = _grads(x, w, dy, monkeypatch, (), "interpret", **kw)
    assert_same_bits((None, *low), (None, *wide))
    if case == 0:
        bad = dict(casting="gemma", offset=1.0)
        forced = _grads(x, w, dy, monkeypatch, (), "interpret", grad_rule=lambda *a, **k: True, **bad)[0]
        right = _grads(x, w, dy, monkeypatch, (), "interpret", **bad)[0]
        assert not np.array_equal(np.asarray(forced, np.float32), np.asarray(right, np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,dt,casting", [(4096, 1024, BF16, "llama"), (4099, 2304, F16, "llama"),
                                            (1000, 8192, BF16, "none"), (300, 4096, F16, "llama")])
def test_gpu_backward_same_bits_as_the_float32_product(m, n, dt, casting, monkeypatch):
    """Compiled (the GPU's bf16x2/f16x2 multiply): the backward's dx and dweight keep the float32 product's bits on
    the heuristic's tile."""
    x, w, dy = jax_inputs((m, n), dt, seed=n, scale=3.0)
    low = _grads(x, w, dy, monkeypatch, ("bfloat16", "float16"), KERNEL, casting=casting)
    wide = _grads(x, w, dy, monkeypatch, (), KERNEL, casting=casting)
    assert_same_bits((None, *low), (None, *wide))


def _triton_outputs(x, r, w, monkeypatch, rule, config=None, **kw):
    """The Triton reference's ``y`` (plain and fused add) under ``rule``."""
    from torch_bridge import triton_kernels

    monkeypatch.setattr(rowmath, "output_in_dtype", rule)
    args = (x, w, 1e-6, kw["offset"], kw["casting"], config)
    return triton_kernels.rms_norm_fwd(*args)[0], triton_kernels.rms_norm_fwd(*args, residual=r, h_dtype=x.dtype)[0]


TRITON_CASES = [((37, 1000), torch.float16, "llama", 0.0, None), ((20, 640), torch.float16, "none", 1.0, None),
                ((37, 1000), torch.float16, "llama", 0.0, "chunked"),
                ((9, 5000), torch.float16, "none", 1.0, "two_pass")]
if DEVICE == "cuda":  # the interpreter keeps bfloat16's float32 product (it would round a bf16 one by truncation)
    TRITON_CASES += [((4096, 5120), torch.bfloat16, "llama", 0.0, None), ((1000, 16384), torch.bfloat16, "none", 0.0,
                                                                         None),
                     ((300, 8192), torch.bfloat16, "llama", 0.0, "chunked")]


@pytest.mark.parametrize("case", range(len(TRITON_CASES)))
def test_triton_reference_same_bits(case, monkeypatch):
    """The Triton reference's forward likewise (resident rows, column chunks and the two-pass walk forced; the
    heuristic's tile pinned: the rule also picks the two-pass warps), plain and fused add. Broken variant: the rule
    forced for gemma changes the bits."""
    from torch_bridge import triton_config, triton_launch

    shape, dt, casting, offset, walk = TRITON_CASES[case]
    x, w, _ = torch_inputs(shape, dt, offset, seed=case, scale=3.0)
    r = torch_inputs(shape, dt, seed=case + 10)[0]
    config = {"chunked": triton_config.chunked_forward_config(),
              "two_pass": triton_config.Config(1, 4096, 16, l1_hints=True)}.get(walk)
    kw = dict(offset=offset, casting=casting,
              config=config or triton_config.forward_config(shape[1], triton_launch.sm_count(x), dt.itemsize))
    low = _triton_outputs(x, r, w, monkeypatch, output_in_dtype, **kw)
    wide = _triton_outputs(x, r, w, monkeypatch, lambda *a: False, **kw)
    for a, b in zip(low, wide):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    if case == 0:
        bad = dict(offset=0.0, casting="gemma")
        forced = _triton_outputs(x, r, w, monkeypatch, lambda *a: True, **bad)[0]
        assert not torch.equal(forced, _triton_outputs(x, r, w, monkeypatch, lambda *a: False, **bad)[0])


def _weight_loaded_before_the_sum(n: int, casting: str, offset: float) -> bool:
    """Whether ``rms_norm``'s forward kernel (resident rows of ``n`` columns) loads the weight (its second ref,
    ``b``) before the row's sum of squares."""
    x = jnp.ones((8, n), BF16)
    text = kernel_jaxpr(lambda a, w: pn.rms_norm(a, w, offset=offset, casting=casting, impl="interpret"), x, x[0])
    return text.index("<- b[") < text.index("reduce_sum")


def test_the_weight_is_loaded_first_at_short_rows_in_float32_too(monkeypatch):
    """With y's product in the input dtype (llama) the weight is loaded before the row up to 8192 columns; with a
    float32 product (gemma) up to ``kernels.WEIGHT_FIRST_F32_MAX_COLS`` (1024: 4096×1024 2.37 → 2.43 TB/s on the
    H100), after the row's sum beyond. The bits are the same either way (the rest of this file, the GPU tests).
    Broken variant: the threshold at 0 loads gemma's weight last."""
    assert _weight_loaded_before_the_sum(1000, "llama", 0.0) and _weight_loaded_before_the_sum(2000, "llama", 0.0)
    assert _weight_loaded_before_the_sum(1000, "gemma", 1.0) and not _weight_loaded_before_the_sum(2000, "gemma", 1.0)
    monkeypatch.setattr(kernels, "WEIGHT_FIRST_F32_MAX_COLS", 0)
    assert not _weight_loaded_before_the_sum(1000, "gemma", 1.0)
