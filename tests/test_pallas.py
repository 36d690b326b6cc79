"""The Pallas kernel against the float64 reference: every casting mode, dtype, offset and shape class."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_norm as pn
from pallas_norm import plan as plan_mod

import ref64

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
CONFIGS = list(itertools.product(DTYPES, pn.CASTINGS, (0.0, 1.0)))


def make_inputs(shape, dtype, offset, seed=0, *, w_dtype=None, scale=2.0):
    """Random x (times ``scale``), non-trivial weight (Gemma: zeros + 0.1·randn) and cotangent dy."""
    kx, kw, kd = jax.random.split(jax.random.key(seed), 3)
    n = shape[-1]
    x = (scale * jax.random.normal(kx, shape, jnp.float32)).astype(dtype)
    base = 0.0 if offset else 1.0
    w = (base + (0.1 if offset else 0.5) * jax.random.normal(kw, (n,), jnp.float32)).astype(w_dtype or dtype)
    dy = jax.random.normal(kd, shape, jnp.float32).astype(dtype)
    return x, w, dy


def run(impl, x, w, dy, **kw):
    y, vjp = jax.vjp(lambda x, w: pn.rms_norm(x, w, impl=impl, **kw), x, w)
    return (y, *vjp(dy))


def check_against_reference(x, w, dy, **kw):
    """Kernel (interpreted) vs float64 reference, with the XLA float32 formula as the naive baseline."""
    got = run("interpret", x, w, dy, **kw)
    naive = run("xla", x, w, dy, **kw)
    y64, _ = ref64.forward(np.asarray(x), None if w is None else np.asarray(w), **kw)
    dx64, dw64 = ref64.backward(np.asarray(x), None if w is None else np.asarray(w), np.asarray(dy), **kw)
    m = int(np.prod(x.shape[:-1]))
    n = x.shape[-1]
    assert got[0].dtype == x.dtype and got[0].shape == x.shape and got[1].dtype == x.dtype
    ref64.assert_close("y", got[0], naive[0], y64, dtype=x.dtype, n_reduce=n)
    ref64.assert_close("dx", got[1], naive[1], dx64, dtype=x.dtype, n_reduce=n)
    if w is not None:
        assert got[2].dtype == w.dtype and got[2].shape == w.shape
        ref64.assert_close("dweight", got[2], naive[2], dw64, dtype=w.dtype, n_reduce=m)


@pytest.mark.parametrize("dtype,casting,offset", CONFIGS)
@pytest.mark.parametrize("shape", [(3, 7), (129, 128), (2, 5, 1000)])
def test_matrix(shape, dtype, casting, offset):
    eps = 1e-6
    x, w, dy = make_inputs(shape, dtype, offset)
    check_against_reference(x, w, dy, eps=eps, offset=offset, casting=casting)


EDGE_SHAPES = [(m, n) for m in (0, 1, 3, 129) for n in (1, 7, 128, 1000, 4096)]


@pytest.mark.parametrize("case", range(len(EDGE_SHAPES)))
def test_shapes(case):
    """Every M × N from the issue, each with a different (dtype, casting, offset) so all of them get covered."""
    shape = EDGE_SHAPES[case]
    dtype, casting, offset = CONFIGS[(7 * case) % len(CONFIGS)]
    x, w, dy = make_inputs(shape, dtype, offset, seed=case)
    if shape[0] == 0:
        y, dx, dw = run("interpret", x, w, dy, offset=offset, casting=casting)
        assert y.shape == shape and dx.shape == shape
        np.testing.assert_array_equal(np.asarray(dw, np.float32), np.zeros(shape[1], np.float32))
        return
    check_against_reference(x, w, dy, eps=1e-6, offset=offset, casting=casting)


@pytest.mark.parametrize("casting", pn.CASTINGS)
def test_chunked_path(monkeypatch, casting):
    """Long rows walk column chunks (forward two passes; backward row sums then column-chunk programs)."""
    monkeypatch.setattr(plan_mod, "MAX_RESIDENT_COLS", 64)
    monkeypatch.setattr(plan_mod, "CHUNK_COLS", 128)
    assert not plan_mod.make_plan(37, 1000).resident
    x, w, dy = make_inputs((37, 1000), jnp.bfloat16, 1.0 if casting == "gemma" else 0.0, seed=3)
    check_against_reference(x, w, dy, eps=1e-5, offset=1.0 if casting == "gemma" else 0.0, casting=casting)


def test_no_weight_and_mixed_weight_dtype():
    x, w, dy = make_inputs((17, 300), jnp.bfloat16, 0.0, seed=4, w_dtype=jnp.float32)
    check_against_reference(x, w, dy, eps=1e-6, offset=0.0, casting="llama")
    check_against_reference(x, None, dy, eps=1e-6, offset=0.0, casting="gemma")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_bitwise_hf_formulas(dtype):
    """Given the same rstd, y equals HF's Llama and Gemma formulas bit for bit (weight dtype == x dtype)."""
    x, w, _ = make_inputs((33, 520), dtype, 0.0, seed=5)
    y, rstd = pn.rms_norm_with_rstd(x, w, casting="llama", impl="interpret")
    x32 = x.astype(jnp.float32)
    hf_llama = w * (x32 * rstd[:, None]).astype(dtype)  # LlamaRMSNorm: weight * h.to(input_dtype)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(hf_llama))
    y, rstd = pn.rms_norm_with_rstd(x, w, casting="gemma", offset=1.0, impl="interpret")
    hf_gemma = ((x32 * rstd[:, None]) * (1.0 + w.astype(jnp.float32))).astype(dtype)  # GemmaRMSNorm
    np.testing.assert_array_equal(np.asarray(y), np.asarray(hf_gemma))
    hf_rstd = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1) + 1e-6)
    np.testing.assert_allclose(np.asarray(rstd), np.asarray(hf_rstd), rtol=4e-7)


def test_bitwise_check_catches_wrong_casting():
    """The bitwise HF check is not vacuous: gemma's single rounding differs from llama's double rounding."""
    x, w, _ = make_inputs((33, 520), jnp.bfloat16, 0.0, seed=5)
    y, rstd = pn.rms_norm_with_rstd(x, w, casting="gemma", offset=0.0, impl="interpret")
    hf_llama = w * (x.astype(jnp.float32) * rstd[:, None]).astype(jnp.bfloat16)
    assert not np.array_equal(np.asarray(y), np.asarray(hf_llama))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_large_magnitudes_stay_finite(dtype):
    """|x| ≈ 300: squares exceed fp16's 65504, but the sum of squares is float32, so outputs stay finite."""
    x, w, dy = make_inputs((9, 256), dtype, 0.0, seed=6, scale=300.0)
    assert float(jnp.max(jnp.abs(x.astype(jnp.float32)))) ** 2 > 65504
    for casting in pn.CASTINGS:
        check_against_reference(x, w, dy, eps=1e-6, offset=0.0, casting=casting)


def test_nan_row_stays_in_its_row():
    x, w, dy = make_inputs((6, 100), jnp.bfloat16, 0.0, seed=7)
    x_bad = x.at[2, 10].set(jnp.nan).at[4].set(0.0)
    y, dx, dw = run("interpret", x_bad, w, dy, casting="llama")
    y_ok, dx_ok, _ = run("interpret", x, w, dy, casting="llama")
    keep = np.array([0, 1, 3, 5])
    np.testing.assert_array_equal(np.asarray(y)[keep], np.asarray(y_ok)[keep])
    np.testing.assert_array_equal(np.asarray(dx)[keep], np.asarray(dx_ok)[keep])
    assert np.all(np.isnan(np.asarray(y[2], np.float32)))
    assert np.all(np.isfinite(np.asarray(y[4], np.float32))) and np.all(np.asarray(y[4], np.float32) == 0)
    assert np.all(np.isnan(np.asarray(dw, np.float32)))


def test_dweight_deterministic_and_multi_program():
    x, w, dy = make_inputs((129, 1000), jnp.float32, 0.0, seed=8)
    assert plan_mod.make_plan(129, 1000).programs > 1  # several partials are really reduced
    grads = [run("interpret", x, w, dy)[2] for _ in range(3)]
    for g in grads[1:]:
        np.testing.assert_array_equal(np.asarray(g), np.asarray(grads[0]))


def test_pallas_impl_needs_gpu():
    if jax.default_backend() == "gpu":
        pytest.skip("a GPU is present")
    with pytest.raises(ValueError, match="impl='pallas' needs a GPU"):
        pn.rms_norm(jnp.ones((2, 8)), impl="pallas")


def _gpu_compare(m, n, casting, offset, dtype=jnp.bfloat16):
    """impl="pallas" vs the XLA formula on the whole tensor (same roundings: ≤ 1 ulp of dt plus float32
    summation error) and vs the float64 reference on a slice of rows."""
    x, w, dy = make_inputs((m, n), dtype, offset, seed=m + n)
    got = run("pallas", x, w, dy, offset=offset, casting=casting)
    naive = run("xla", x, w, dy, offset=offset, casting=casting)
    eps_dt = ref64.EPS[jnp.dtype(dtype).name]
    for name, a, b, k in zip(("y", "dx", "dweight"), got, naive, (n, n, m)):
        a64, b64 = ref64.to64(a), ref64.to64(b)
        scale = float(np.max(np.abs(b64)))
        tol = scale * (eps_dt + 4 * np.sqrt(k) * ref64.EPS["float32"])
        assert float(np.max(np.abs(a64 - b64))) <= tol, f"{name} {m}x{n}: pallas vs xla beyond {tol:.3e}"
    rows = np.r_[0:64, m - 64:m] if m > 128 else np.arange(m)
    xs, dys = np.asarray(x)[rows], np.asarray(dy)[rows]
    y64, _ = ref64.forward(xs, np.asarray(w), eps=1e-6, offset=offset, casting=casting)
    dx64, _ = ref64.backward(xs, np.asarray(w), dys, eps=1e-6, offset=offset, casting=casting)
    ref64.assert_close("y rows", np.asarray(got[0])[rows], np.asarray(naive[0])[rows], y64, dtype=dtype, n_reduce=n)
    ref64.assert_close("dx rows", np.asarray(got[1])[rows], np.asarray(naive[1])[rows], dx64, dtype=dtype,
                       n_reduce=n)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,casting,offset", [
    (32768, 4096, "llama", 0.0), (65536, 2304, "gemma", 1.0), (4096, 65536, "llama", 0.0),
    (1024, 262144, "gemma", 1.0), (4099, 1000, "none", 0.0), (7, 7, "llama", 1.0)])
def test_gpu_large_shapes(m, n, casting, offset):
    _gpu_compare(m, n, casting, offset)


@pytest.mark.gpu
@pytest.mark.parametrize("config", CONFIGS)
def test_gpu_matrix(config):
    dtype, casting, offset = config
    x, w, dy = make_inputs((257, 3000), dtype, offset, seed=1)
    got = run("pallas", x, w, dy, offset=offset, casting=casting)
    naive = run("xla", x, w, dy, offset=offset, casting=casting)
    y64, _ = ref64.forward(np.asarray(x), np.asarray(w), eps=1e-6, offset=offset, casting=casting)
    dx64, dw64 = ref64.backward(np.asarray(x), np.asarray(w), np.asarray(dy), eps=1e-6, offset=offset,
                                casting=casting)
    for name, a, b, r, k in zip(("y", "dx", "dweight"), got, naive, (y64, dx64, dw64), (3000, 3000, 257)):
        ref64.assert_close(name, a, b, r, dtype=dtype, n_reduce=k)


@pytest.mark.gpu
def test_gpu_dweight_bitwise_reproducible():
    x, w, dy = make_inputs((32768, 4096), jnp.bfloat16, 0.0, seed=2, w_dtype=jnp.float32)
    grad = jax.jit(jax.grad(lambda w: jnp.sum(pn.rms_norm(x, w, impl="pallas").astype(jnp.float32) * dy)))
    first = np.asarray(grad(w))
    for _ in range(5):
        np.testing.assert_array_equal(np.asarray(grad(w)), first)
