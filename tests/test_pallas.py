"""The Pallas kernel against the float64 reference: every casting mode, dtype, offset and shape class."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_norm as pn
from pallas_norm import dweight, pallas_config, triton_ffi
from pallas_norm.pallas_config import Config

from helpers import GPU_KERNELS, JAX_DTYPES, KERNEL, ON_GPU, ON_HOPPER, check_jax, check_reduction_order, jax_inputs
from helpers import jax_vjp

CONFIGS = list(itertools.product(JAX_DTYPES, pn.CASTINGS, (0.0, 1.0)))
# both lowerings' compiled kernels, for the GPU tests that hold each to the same contract
GPU_IMPLS = [pytest.param(i, marks=pytest.mark.skipif(i == "mosaic" and not ON_HOPPER, reason="needs a Hopper GPU"))
             for i in GPU_KERNELS]


def check_against_reference(x, w, dy, **kw):
    """The kernel (interpreted on CPU) held to the accuracy rule of ``pallas_norm.accuracy``."""
    check_jax(x, w, dy, "interpret", **kw)


@pytest.mark.parametrize("dtype,casting,offset", CONFIGS)
@pytest.mark.parametrize("shape", [(3, 7), (129, 128), (2, 5, 1000)])
def test_matrix(shape, dtype, casting, offset):
    eps = 1e-6
    x, w, dy = jax_inputs(shape, dtype, offset, scale=2.0)
    check_against_reference(x, w, dy, eps=eps, offset=offset, casting=casting)


EDGE_SHAPES = [(m, n) for m in (0, 1, 3, 129) for n in (1, 7, 128, 1000, 4096)]


@pytest.mark.parametrize("case", range(len(EDGE_SHAPES)))
def test_shapes(case):
    """Every M × N of the edge grid (empty, single row and column, non-powers of two), each with a different
    (dtype, casting, offset) so all of them get covered."""
    shape = EDGE_SHAPES[case]
    dtype, casting, offset = CONFIGS[(7 * case) % len(CONFIGS)]
    x, w, dy = jax_inputs(shape, dtype, offset, seed=case)
    if shape[0] == 0:
        y, dx, dw = jax_vjp("interpret", x, w, dy, offset=offset, casting=casting)
        assert y.shape == shape and dx.shape == shape
        np.testing.assert_array_equal(np.asarray(dw, np.float32), np.zeros(shape[1], np.float32))
        return
    check_against_reference(x, w, dy, eps=1e-6, offset=offset, casting=casting)


CHUNKED = Config(block_rows=1, block_cols=128, num_warps=1)  # 1000-wide rows in 8 column chunks


def test_forward_heuristic_tiles_full_rows_by_the_table(monkeypatch):
    """Rows filling more than ``PADDED_FILL`` of their padded length take ``FWD_RESIDENT``'s tile at any row count
    (4096×1024 and 32768×1024 alike; tiny inputs fewer rows), the fused add's forward ``FWD_ADD_RESIDENT``'s;
    lengths off the tables keep the ``TARGET_ELEMS`` rule. (Where ``triton_ffi`` is available, rows of 16384 take
    ``FWD_FFI_RESIDENT``'s instead: ``tests/test_triton_ffi.py``.)"""
    monkeypatch.setattr(triton_ffi, "available", lambda: False)
    tiles = {(m, n): (c.block_rows, c.num_warps) for m, n in ((4096, 1024), (32768, 1024), (4096, 2048),
                                                             (32768, 4096), (4096, 8192), (4096, 16384), (3, 1024),
                                                             (1, 4096), (32768, 512))
             for c in [pallas_config.heuristic(m, n, backward=False)]}
    assert tiles == {(4096, 1024): (2, 4), (32768, 1024): (2, 4), (4096, 2048): (2, 8), (32768, 4096): (2, 16),
                     (4096, 8192): (1, 8), (4096, 16384): (1, 32), (3, 1024): (2, 4), (1, 4096): (1, 16),
                     (32768, 512): (16, 8)}
    fused = {n: (c.block_rows, c.num_warps) for n in (1024, 2048, 2304, 4096, 16384)
             for c in [pallas_config.heuristic(4096, n, backward=False, fused=True)]}
    assert fused == {1024: (4, 4), 2048: (1, 8), 2304: (1, 4), 4096: (1, 16), 16384: (1, 8)}  # FWD_ADD_RESIDENT


def test_fused_add_forward_runs_the_plain_forward_s_warps(monkeypatch):
    """A row's sum is reduced in an order set by the warps, so the fused add's forward (whose y must be
    ``rms_norm(h)``'s bits) runs the plain forward's warps at every width (its rows per program may differ), but at
    16384 columns without jaxlib's launch (documented: 8 warps against 32). Broken variant: the seventeenth
    session's table (2 rows on 1 warp at 1024), whose bits the GPU test in test_triton_ffi.py shows differ."""
    monkeypatch.setattr(triton_ffi, "available", lambda: False)
    for n in (64, 128, 256, 512, 1000, 1024, 2048, 2304, 3584, 4096, 5120, 8192, 16384):
        plain, fused = (pallas_config.heuristic(4096, n, backward=False, fused=f) for f in (False, True))
        assert (fused.num_warps == plain.num_warps) == (n != 16384), n
    monkeypatch.setattr(pallas_config, "FWD_ADD_RESIDENT", {**pallas_config.FWD_ADD_RESIDENT, 1024: (2, 1)})
    assert pallas_config.heuristic(4096, 1024, backward=False, fused=True).num_warps == 1


def test_forward_heuristic_halves_padded_rows():
    """Rows filling at most ``PADDED_FILL`` of their padded block get half the rows per program (the warps
    following: a warp per ``FWD_ELEMS_PER_WARP`` padded elements); fuller rows keep the default tile."""
    tiles = {n: (c.block_rows, c.num_warps) for n in (2304, 3072, 1536, 3584, 4096, 2048)
             for c in [pallas_config.heuristic(32768, n, backward=False)]}
    assert tiles == {2304: (1, 4), 3072: (1, 4), 1536: (2, 4), 3584: (2, 16), 4096: (2, 16), 2048: (2, 8)}


@pytest.mark.parametrize("casting", pn.CASTINGS)
def test_chunked_path(casting):
    """Long rows walk column chunks (forward two passes; backward row sums then column-chunk programs), forced
    on short rows by a config passed through the public API."""
    assert not CHUNKED.resident(1000) and pallas_config.heuristic(37, 1000, backward=False).resident(1000)
    offset = 1.0 if casting == "gemma" else 0.0
    x, w, dy = jax_inputs((37, 1000), jnp.bfloat16, offset, seed=3)
    kw = dict(eps=1e-5, offset=offset, casting=casting)
    check_jax(x, w, dy, "interpret", config=CHUNKED, bwd_config=CHUNKED, **kw)
    jaxpr = str(jax.make_jaxpr(lambda a, b: jax_vjp("interpret", a, b, dy, config=CHUNKED, bwd_config=CHUNKED,
                                                     **kw))(x, w))
    assert "pallas_norm_bwd_rowsum" in jaxpr and "pallas_norm_bwd_chunks" in jaxpr  # the chunked kernels ran


ACCESS_CASES = {  # (config, bwd_config) on 37×1000 rows: resident rows over a persistent grid of 3 programs
    "resident": (Config(4, 1024, 4), Config(2, 1024, 4, programs=3, prefetch=True)),
    "chunked": (Config(1, 256, 2, programs=5, prefetch=True), Config(1, 256, 2, programs=3, prefetch=True)),
    "reloaded weight": (Config(4, 1024, 4), Config(2, 1024, 4, programs=3, prefetch=True, reload_weight=True)),
}


def _bits(x, w, dy, configs):
    """The kernels' outputs: compiled on a GPU (under the interpreter, XLA:GPU fuses the two walks' jaxprs
    differently and one element of dx moved by an ulp on the H100), interpreted on CPU."""
    return [np.asarray(v) for v in jax_vjp(KERNEL, x, w, dy, config=configs[0], bwd_config=configs[1])]


@pytest.mark.parametrize("case", sorted(ACCESS_CASES))
def test_access_order_changes_no_bits(case, monkeypatch):
    """Loading the next tile before using the current one (``prefetch``), reloading the weight per row block and
    walking a long row's second pass backwards change memory accesses only: y, dx and dweight keep their bits.
    Negative control: a walk that hands each step the tile fetched for the next one is caught."""
    from pallas_norm import kernels

    x, w, dy = jax_inputs((37, 1000), jnp.bfloat16, 0.0, seed=11)
    on = ACCESS_CASES[case]
    off = tuple(dataclasses.replace(c, prefetch=False, reload_weight=False) for c in on)
    want = _bits(x, w, dy, off)
    for got, ref in zip(_bits(x, w, dy, on), want):
        np.testing.assert_array_equal(got, ref)

    walk = kernels._walk
    monkeypatch.setattr(kernels, "_walk", lambda steps, prefetch, fetch, use, carry: walk(
        steps, prefetch, lambda k: fetch(k + 1) if prefetch else fetch(k), use, carry))
    fresh = tuple(dataclasses.replace(c, num_warps=2 * c.num_warps) for c in on)  # new cache keys: traced anew
    broken = _bits(x, w, dy, fresh)
    assert not all(np.array_equal(g, r) for g, r in zip(broken, want))


def _balanced(balanced) -> bool:
    """Whether ``balanced(programs, blocks)`` gives every grid the most blocks per program of ``programs`` programs
    (or of one per block) on the fewest programs."""
    for blocks, programs in itertools.product(range(1, 3000, 7), (1, 2, 128, 132, 264, 528, 5000)):
        p, most = balanced(programs, blocks), -(-blocks // min(programs, blocks))
        if not (p <= min(programs, blocks) and -(-blocks // p) == most and (p == 1 or -(-blocks // (p - 1)) > most)):
            return False
    return True


def test_resident_backward_takes_the_balanced_grid(monkeypatch):
    """``pallas_config.balanced`` keeps the most row blocks per program on the fewest programs; the resident
    backward's heuristic takes it (4096×4096: 2048 blocks on 128 programs of 16, not 132 of 15-16), plain and fused
    add alike (one grid, one dweight order), the pieces keep theirs. Broken variant: the grid clamped to the blocks
    only, as before."""
    assert _balanced(pallas_config.balanced)
    assert not _balanced(lambda programs, blocks: min(programs, blocks))
    monkeypatch.setattr(pallas_config.backend, "num_sms", lambda: 132)
    for (m, n), programs in {(4096, 4096): 128, (4096, 1024): 512, (32768, 1024): 512, (32768, 4096): 132,
                             (4096, 2304): 528, (3000, 2048): 250}.items():
        plain, fused = (pallas_config.heuristic(m, n, backward=True, fused=f) for f in (False, True))
        assert plain.programs == fused.programs == programs, (m, n)


@pytest.mark.parametrize("casting", ["llama", "gemma"])
def test_small_backward_is_one_launch(casting):
    """A backward of at most ``ONE_PROGRAM_ELEMS`` elements runs one program that stores dweight itself (no
    partials, no reduction kernel); a larger one, or a forced grid of several programs, reduces the partials.
    Both held to the accuracy rule."""
    offset = 1.0 if casting == "gemma" else 0.0
    kw = dict(eps=1e-6, offset=offset, casting=casting)
    small = pallas_config.ONE_PROGRAM_ELEMS // 512
    assert pallas_config.heuristic(small, 512, backward=True).programs == 1
    assert pallas_config.heuristic(small + 1, 512, backward=True).programs > 1
    for rows, bwd_config, reduced in ((small, None, False), (37, Config(2, 512, 4, programs=3), True)):
        x, w, dy = jax_inputs((rows, 500), jnp.bfloat16, offset, seed=12)
        check_jax(x, w, dy, "interpret", bwd_config=bwd_config, **kw)
        jaxpr = str(jax.make_jaxpr(lambda a, b: jax_vjp("interpret", a, b, dy, bwd_config=bwd_config, **kw))(x, w))
        assert "pallas_norm_bwd" in jaxpr and ("pallas_norm_dweight_reduce" in jaxpr) == reduced


@pytest.mark.parametrize("parts, n", [(1, 1000), (8, 1000), (37, 1000), (300, 1000), (37, 12)])
def test_dweight_reduction_order(parts, n, monkeypatch):
    """The reduction kernel (``dweight.reduce_dweight``) adds the float32 partial rows in one fixed order. Default
    tiles: the same bits on every call, within float32 rounding of the float64 sum (37, 300: ragged tiles, a
    remainder after the unrolled steps, a ragged last column tile; 12 columns: the narrowest tiles,
    ``reduce_cols``). One lane (``REDUCE_ROWS = 1``): the bits of adding the rows one after another, p = 0, 1, ....
    Broken variants: a row left out (off by more than the rounding bound); the rows reversed (one lane: other
    bits)."""
    partials = np.asarray(jax.random.normal(jax.random.PRNGKey(parts), (parts, n), jnp.float32) * 1e3)
    check_reduction_order(
        lambda p: np.asarray(dweight.reduce_dweight(jnp.asarray(p), jnp.float32, interpret=not ON_GPU)), partials,
        lambda: monkeypatch.setattr(dweight, "REDUCE_ROWS", 1))


def test_reduce_cols():
    """The dweight reductions' columns per program (``dweight.reduce_cols``): the narrowest power of two from
    ``REDUCE_MIN_COLS`` that gives at most one program per SM, at most the kernel's width. On an H100's 132 SMs:
    8 columns at 1024 (528 partial rows: 128 programs instead of 32), 16 at 2048, the full 32 from 3584. Broken
    variant: the fixed width leaves SMs idle at 1024 columns."""
    def rule(n, cols, sms):
        width = dweight.REDUCE_MIN_COLS
        while width < cols and -(-n // width) > sms:
            width *= 2
        return width

    def follows_rule(fn) -> bool:
        return all(fn(n, cols, sms) == rule(n, cols, sms) for sms in (8, 114, 132) for cols in (32, 64)
                   for n in (1, 12, 128, 1000, 1024, 1100, 2048, 2304, 3584, 4096, 16384, 262144))

    assert follows_rule(dweight.reduce_cols)
    assert [dweight.reduce_cols(n, 32, 132) for n in (128, 1024, 2048, 3584, 8192)] == [8, 8, 16, 32, 32]
    assert not follows_rule(lambda n, cols, sms: cols)  # the fixed width


def test_jax_reduce_tile(monkeypatch):
    """``reduce_dweight``'s tile (``dweight.jax_reduce_tile``) on an H100's 132 SMs: the shared ``reduce_tile`` with
    at most 16 lanes where its columns number 16 or more (528 partial rows of 2304 columns 2.81 → 2.62 µs), 32 lanes
    on the 8 columns of 1024-column rows (16 there was slower), a band grid's few partial rows' wide tile unchanged.
    Broken variants: the cap on every width, and no cap."""
    cases = {(528, 2304): (16, 32), (264, 5120): (16, 32), (256, 2048): (16, 16), (528, 1024): (32, 8),
             (4, 262144): (4, 256)}

    def tiles() -> dict:
        return {key: dweight.jax_reduce_tile(*key, 132) for key in cases}

    assert tiles() == cases
    assert all(dweight.reduce_tile(p, n, 132, dweight.REDUCE_ROWS, dweight.REDUCE_COLS, dweight.REDUCE_MAX_COLS)[1]
               == cols for (p, n), (_, cols) in cases.items())  # the width is reduce_tile's
    for name, broken in (("REDUCE_WIDE_COLS", 8), ("REDUCE_WIDE_ROWS", dweight.REDUCE_ROWS)):
        with monkeypatch.context() as patch:
            patch.setattr(dweight, name, broken)
            assert tiles() != cases


def test_bad_configs():
    with pytest.raises(ValueError, match="block_cols must be a power of two"):
        Config(block_rows=1, block_cols=100, num_warps=4)
    x = jnp.ones((2, 8))
    with pytest.raises(TypeError, match="config must be a pallas_norm.pallas_config.Config or None"):
        pn.rms_norm(x, impl="interpret", config=(1, 8, 1))
    with pytest.raises(ValueError, match="bwd_config tiles the Pallas kernels; impl='xla' takes none"):
        pn.rms_norm(x, impl="xla", bwd_config=CHUNKED)


def test_no_weight_and_mixed_weight_dtype():
    x, w, dy = jax_inputs((17, 300), jnp.bfloat16, 0.0, seed=4, weight_dtype=jnp.float32)
    check_against_reference(x, w, dy, eps=1e-6, offset=0.0, casting="llama")
    check_against_reference(x, None, dy, eps=1e-6, offset=0.0, casting="gemma")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_bitwise_hf_formulas(dtype):
    """Given the same rstd, y equals HF's Llama and Gemma formulas bit for bit (weight dtype == x dtype)."""
    x, w, _ = jax_inputs((33, 520), dtype, 0.0, seed=5)
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
    x, w, _ = jax_inputs((33, 520), jnp.bfloat16, 0.0, seed=5)
    y, rstd = pn.rms_norm_with_rstd(x, w, casting="gemma", offset=0.0, impl="interpret")
    hf_llama = w * (x.astype(jnp.float32) * rstd[:, None]).astype(jnp.bfloat16)
    assert not np.array_equal(np.asarray(y), np.asarray(hf_llama))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_large_magnitudes_stay_finite(dtype):
    """|x| ≈ 300: squares exceed fp16's 65504, but the sum of squares is float32, so outputs stay finite."""
    x, w, dy = jax_inputs((9, 256), dtype, 0.0, seed=6, scale=300.0)
    assert float(jnp.max(jnp.abs(x.astype(jnp.float32)))) ** 2 > 65504
    for casting in pn.CASTINGS:
        check_against_reference(x, w, dy, eps=1e-6, offset=0.0, casting=casting)


def test_nan_row_stays_in_its_row():
    x, w, dy = jax_inputs((6, 100), jnp.bfloat16, 0.0, seed=7)
    x_bad = x.at[2, 10].set(jnp.nan).at[4].set(0.0)
    y, dx, dw = jax_vjp("interpret", x_bad, w, dy, casting="llama")
    y_ok, dx_ok, _ = jax_vjp("interpret", x, w, dy, casting="llama")
    keep = np.array([0, 1, 3, 5])
    np.testing.assert_array_equal(np.asarray(y)[keep], np.asarray(y_ok)[keep])
    np.testing.assert_array_equal(np.asarray(dx)[keep], np.asarray(dx_ok)[keep])
    assert np.all(np.isnan(np.asarray(y[2], np.float32)))
    assert np.all(np.isfinite(np.asarray(y[4], np.float32))) and np.all(np.asarray(y[4], np.float32) == 0)
    assert np.all(np.isnan(np.asarray(dw, np.float32)))


def test_dweight_deterministic_and_multi_program():
    x, w, dy = jax_inputs((129, 1000), jnp.float32, 0.0, seed=8)
    assert pallas_config.heuristic(129, 1000, backward=True).programs > 1  # several partials are really reduced
    grads = [jax_vjp("interpret", x, w, dy)[2] for _ in range(3)]
    for g in grads[1:]:
        np.testing.assert_array_equal(np.asarray(g), np.asarray(grads[0]))


def test_pallas_impl_needs_gpu():
    if jax.default_backend() == "gpu":
        pytest.skip("a GPU is present")
    with pytest.raises(ValueError, match="impl='pallas' needs a GPU"):
        pn.rms_norm(jnp.ones((2, 8)), impl="pallas")


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,casting,offset", [
    (32768, 4096, "llama", 0.0), (65536, 2304, "gemma", 1.0), (4096, 65536, "llama", 0.0),
    (1024, 262144, "gemma", 1.0), (4099, 1000, "none", 0.0), (7, 7, "llama", 1.0)])
def test_gpu_large_shapes(m, n, casting, offset):
    """The compiled kernel on every element of LLM-sized inputs, held to the accuracy rule."""
    x, w, dy = jax_inputs((m, n), jnp.bfloat16, offset, seed=m + n)
    check_jax(x, w, dy, "pallas", offset=offset, casting=casting)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", GPU_IMPLS)
@pytest.mark.parametrize("config", CONFIGS)
def test_gpu_matrix(config, impl):
    dtype, casting, offset = config
    x, w, dy = jax_inputs((257, 3000), dtype, offset, seed=1)
    check_jax(x, w, dy, impl, offset=offset, casting=casting)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", GPU_IMPLS)
def test_gpu_dweight_bitwise_reproducible(impl):
    x, w, dy = jax_inputs((32768, 4096), jnp.bfloat16, 0.0, seed=2, weight_dtype=jnp.float32)
    grad = jax.jit(jax.grad(lambda w: jnp.sum(pn.rms_norm(x, w, impl=impl).astype(jnp.float32) * dy)))
    first = np.asarray(grad(w))
    for _ in range(5):
        np.testing.assert_array_equal(np.asarray(grad(w)), first)
