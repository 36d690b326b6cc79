"""``backend.row_ops``: how the band backward widens, rounds and multiply-adds. On a GPU, bf16 rows take PTX on pairs
of elements: the widening and the rounding give ``astype``'s bits (every bf16 value; float32 values with ties, NaN,
infinities, subnormals), the multiply-add rounds once. On CPU (the interpreter) and for other dtypes: plain jnp."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_norm import backend
from pallas_norm.rounding import rounder

from helpers import ON_GPU

SHAPE = (256, 256)


def test_interpreter_and_other_dtypes_take_plain_ops(monkeypatch):
    """The interpreter cannot run PTX; fp16 and float32 rows keep ``astype``/``rounder`` and an unfused a·b + c; so
    does a GPU older than compute capability 8.0 (no ``cvt.rn.bf16x2.f32``)."""
    for dt, interpret in ((jnp.bfloat16, True), (jnp.float16, False), (jnp.float32, False)):
        ops = backend.row_ops(dt, interpret=interpret)
        assert not ops.fused
        a, b, c = (jnp.float32(v) for v in (1.5, 3.0, -0.25))
        assert ops.mul_add(a, b, c) == a * b + c
        assert ops.widen(jnp.ones(4, dt)).dtype == jnp.float32
    assert backend.row_ops(jnp.bfloat16, interpret=False).fused
    for cc, fused in ((75, False), (80, True), (90, True)):
        monkeypatch.setattr(backend, "compute_capability", lambda cc=cc: cc)
        assert backend.row_ops(jnp.bfloat16, interpret=False).fused == fused


def _kernel_apply(fn, *arrays, out_dtype=jnp.float32):
    """``fn`` of the arrays' values inside one compiled Triton-lowered kernel (the whole array one block)."""
    def kernel(*refs):
        *ins, out = refs
        out[...] = fn(*(r[...] for r in ins))

    return np.asarray(pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(arrays[0].shape, out_dtype),
                                     compiler_params=backend.compiler_params(4), name="pallas_norm_test_row_ops")(
        *arrays))


def _f32_values(seed: int) -> np.ndarray:
    """float32 values over 30 binades, bf16 ties (exactly halfway, both parities), subnormals, NaN, ±inf, ±0."""
    rng = np.random.default_rng(seed)
    v = (rng.standard_normal(SHAPE[0] * SHAPE[1]) * np.logspace(-40, 38, SHAPE[0] * SHAPE[1])).astype(np.float32)
    ties = (rng.integers(0, 1 << 16, 256, dtype=np.uint32) << 16 | 0x8000).view(np.float32)
    v[:256] = ties
    v[256:264] = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, -3e-39, 3.4e38]
    return v.reshape(SHAPE)


gpu = pytest.mark.gpu


@gpu
def test_gpu_pairs_widen_every_bf16_value_to_its_bits():
    """All 65536 bf16 bit patterns widened as pairs: each float32 is the pattern shifted left by 16 (NaN payloads
    kept). Broken variant: the pair's halves swapped (``$0`` given the high half), caught."""
    assert ON_GPU
    u16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).reshape(SHAPE)
    x = jnp.asarray(u16.view(jnp.bfloat16))
    want = (u16.astype(np.uint32) << 16).view(np.int32)
    got = _kernel_apply(backend.row_ops(jnp.bfloat16, interpret=False).widen, x)
    np.testing.assert_array_equal(got.view(np.int32), want)
    swapped = _kernel_apply(lambda t: backend._ptx("and.b32 $0, $2, 0xffff0000;\n\tshl.b32 $1, $2, 16;", [t],
                                                   "=r,=r,r", 2, jnp.float32), x)
    assert not np.array_equal(swapped.view(np.int32), want)


@gpu
def test_gpu_pairs_round_to_nearest_even_like_astype():
    """float32 values rounded to bf16 and widened as pairs: ``rounder``'s values (XLA's convert on the GPU), NaN where
    it has NaN. Broken variant: rounding toward zero (``cvt.rz``), caught on the ties and elsewhere."""
    assert ON_GPU
    v = jnp.asarray(_f32_values(1))
    want = np.asarray(jax.jit(rounder(jnp.bfloat16))(v))
    got = _kernel_apply(backend.row_ops(jnp.bfloat16, interpret=False).round, v)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.int32), want[~nan].view(np.int32))
    rz = _kernel_apply(lambda t: backend._ptx("{\n\t.reg .b32 t;\n\tcvt.rz.bf16x2.f32 t, $3, $2;\n\t"
                                              "shl.b32 $0, t, 16;\n\tand.b32 $1, t, 0xffff0000;\n\t}", [t],
                                              "=r,=r,r,r", 2, jnp.float32), v)
    assert not np.array_equal(rz[~nan].view(np.int32), want[~nan].view(np.int32))


@gpu
def test_gpu_mul_add_rounds_once():
    """``mul_add(a, b, c)`` on bf16 rows is a·b + c rounded once (float64's exact product plus c, rounded to
    float32); the unfused float32 a·b + c (two roundings) differs from it somewhere, so the fusion is real."""
    assert ON_GPU
    rng = np.random.default_rng(2)
    a, b, c = (rng.standard_normal(SHAPE).astype(np.float32) for _ in range(3))
    got = _kernel_apply(backend.row_ops(jnp.bfloat16, interpret=False).mul_add, *map(jnp.asarray, (a, b, c)))
    want = (a.astype(np.float64) * b + c).astype(np.float32)
    np.testing.assert_array_equal(got, want)
    assert not np.array_equal(got, a * b + c)
