"""The Mosaic GPU kernels (``impl="mosaic"``; ``"mosaic_interpret"`` on CPU) against the float64 reference: every
casting mode, dtype and offset, the padded-row path, forced tilings (block rows, stages, weight staging, several
programs, ragged last blocks), edge shapes, NaN rows, the long-row limit, the lowering for Hopper; LLM sizes on the
GPU (clusters: tests/test_mosaic_clusters.py; the GPU matrix and dweight reproducibility: tests/test_pallas.py, for
both lowerings)."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_norm as pn
from pallas_norm import backend, mosaic, mosaic_config
from pallas_norm.mosaic_config import MosaicConfig

from helpers import JAX_DTYPES, MOSAIC, ON_HOPPER, check_jax, hopper, jax_inputs, jax_vjp, judge

CONFIGS = list(itertools.product(JAX_DTYPES, pn.CASTINGS, (0.0, 1.0)))


@pytest.mark.parametrize("case", range(len(CONFIGS)))
def test_matrix(case):
    """Each (dtype, casting, offset) once, on rows of 128·k columns (no padding) or of 1000 (padded to 1024)."""
    dtype, casting, offset = CONFIGS[case]
    shape = (5, 384) if case % 2 else (2, 3, 1000)
    x, w, dy = jax_inputs(shape, dtype, offset, seed=case, scale=2.0)
    check_jax(x, w, dy, MOSAIC, eps=1e-6, offset=offset, casting=casting)


# The staged forward (direct=False; by default the forward of such rows runs direct: test_mosaic_direct.py)
TILINGS = [MosaicConfig(block_rows=4, stages=3, hold=True, direct=False),
           MosaicConfig(block_rows=2, stages=1, weight_in_smem=False, direct=False),
           MosaicConfig(block_rows=1, stages=2, programs_per_sm=2, direct=False),
           MosaicConfig(block_rows=8, stages=2, hold=False, direct=False),
           MosaicConfig(block_rows=1, stages=4, programs_per_sm=2, direct=False)]


@pytest.mark.parametrize("config", TILINGS, ids=str)
def test_tilings(config):
    """Forced configs through the public API: several programs with ragged ranges, ragged last blocks (37 rows),
    in-place staging with 1 to 4 stages (4: more stages than some programs have blocks), the weight from shared or
    global memory, rows held in registers between the two walks or read again (both directions)."""
    x, w, dy = jax_inputs((37, 1536), jnp.bfloat16, 1.0, seed=3)
    plan = mosaic_config.fit(config, 37, 1536, row_bytes=4, weight_bytes=2, widest=2, backward=True)
    assert plan.programs > 1 or plan.block_rows > 1
    check_jax(x, w, dy, MOSAIC, casting="gemma", offset=1.0, config=config, bwd_config=config)


@pytest.mark.parametrize("shape", [(0, 256), (1, 1), (3, 7), (2, 128), (4, 1152)])
def test_edge_shapes(shape):
    x, w, dy = jax_inputs(shape, jnp.float16, 0.0, seed=sum(shape))
    if shape[0] == 0:
        y, dx, dw = jax_vjp(MOSAIC, x, w, dy)
        assert y.shape == shape and dx.shape == shape
        np.testing.assert_array_equal(np.asarray(dw, np.float32), np.zeros(shape[1], np.float32))
        return
    check_jax(x, w, dy, MOSAIC, casting="none")


def test_padding_is_checked(monkeypatch):
    """A row of 1000 columns is padded to 1024 with zeros; the broken variant (padding with ones, which enter the
    sum of squares) is caught by the same check."""
    x, w, dy = jax_inputs((3, 1000), jnp.float32, 0.0, seed=11)
    check_jax(x, w, dy, MOSAIC)
    ones = lambda a, n_pad: a if a is None or a.shape[-1] == n_pad else jnp.concatenate(  # noqa: E731
        [a, jnp.ones(a.shape[:-1] + (n_pad - a.shape[-1],), a.dtype)], axis=-1)
    monkeypatch.setattr(mosaic, "_pad_cols", ones)
    jax.clear_caches()
    try:
        assert judge(x, w, dy, jax_vjp(MOSAIC, x, w, dy))
    finally:
        jax.clear_caches()  # no later test may find the broken variant's traces


def test_nan_row_stays_in_its_row():
    x, w, dy = jax_inputs((6, 256), jnp.bfloat16, 0.0, seed=7)
    x_bad = x.at[2, 10].set(jnp.nan).at[4].set(0.0)
    y, dx, dw = jax_vjp(MOSAIC, x_bad, w, dy)
    y_ok, dx_ok, _ = jax_vjp(MOSAIC, x, w, dy)
    keep = np.array([0, 1, 3, 5])
    np.testing.assert_array_equal(np.asarray(y)[keep], np.asarray(y_ok)[keep])
    np.testing.assert_array_equal(np.asarray(dx)[keep], np.asarray(dx_ok)[keep])
    assert np.all(np.isnan(np.asarray(y[2], np.float32)))
    assert np.all(np.asarray(y[4], np.float32) == 0)
    assert np.all(np.isnan(np.asarray(dw, np.float32)))


def test_errors():
    with pytest.raises(TypeError, match="MosaicConfig"):
        pn.rms_norm(jnp.ones((2, 128)), impl="mosaic_interpret", config=pn.Config(1, 128, 1))
    with pytest.raises(TypeError, match="pallas_config.Config"):
        pn.rms_norm(jnp.ones((2, 128)), impl="interpret", config=MosaicConfig())
    for bad in (dict(block_rows=0), dict(stages=1.5), dict(cluster=3), dict(weight_in_smem=1), dict(hold=0)):
        with pytest.raises(ValueError):
            MosaicConfig(**bad)
    with pytest.raises(mosaic_config.Unsupported, match="shared memory of 16 SMs"):  # 32768 columns per CTA: x, dy
        mosaic_config.fit(None, 2, 524288, row_bytes=4, weight_bytes=2, widest=2, backward=True)  # and the spill
    if not ON_HOPPER:
        with pytest.raises(ValueError, match="compute capability"):
            pn.rms_norm(jnp.ones((2, 128)), impl="mosaic")


def test_backward_heuristic_stages(monkeypatch):
    """The backward of rows one CTA holds takes a fourth stage for small blocks of rows over 1024 columns
    (``SMALL_BLOCK_STAGES``: at most 2560 elements per row buffer) walked by at most 32 blocks per CTA (on an H100's
    132 SMs, 2 CTAs each); otherwise 3. The forward stages nothing (direct)."""
    monkeypatch.setattr(backend, "num_sms", lambda: 132)
    stages = {(m, n): mosaic_config.heuristic(m, n, backward=True).stages
              for m, n in ((4096, 2304), (8192, 2560), (4096, 1280), (8448, 2304), (8449, 2304), (32768, 2304),
                           (4096, 1536), (4096, 3072), (4096, 4096), (4096, 1024), (4096, 640))}
    assert stages == {(4096, 2304): 4, (8192, 2560): 4, (4096, 1280): 4, (8448, 2304): 4, (8449, 2304): 3,
                      (32768, 2304): 3, (4096, 1536): 3, (4096, 3072): 3, (4096, 4096): 3, (4096, 1024): 3,
                      (4096, 640): 3}
    assert mosaic_config.heuristic(4096, 2304, backward=False) == MosaicConfig(block_rows=1, direct=True)


def test_fit_splits_long_rows_over_a_cluster():
    plan = mosaic_config.fit(None, 1024, 262144, row_bytes=2, weight_bytes=2, widest=2, backward=False)
    assert plan.cluster == 16 and plan.width == 16384 and plan.hold
    plan = mosaic_config.fit(None, 2048, 131072, row_bytes=4, weight_bytes=2, widest=2, backward=True)
    assert plan.cluster == 16 and plan.width == 8192 and plan.dw_spill == 0 and plan.hold
    plan = mosaic_config.fit(None, 1024, 262144, row_bytes=4, weight_bytes=2, widest=2, backward=True)
    assert plan.cluster == 16 and plan.width == 16384 and plan.dw_spill == 8192 and not plan.hold
    # a cluster whose share keeps dweight in registers comes before a smaller one that spills
    plan = mosaic_config.fit(None, 64, 16384, row_bytes=4, weight_bytes=2, widest=2, backward=True)
    assert plan.cluster == 2 and plan.dw_spill == 0
    # the interpreter (one CTA per row) spills like the GPU where shared memory allows, else keeps it all
    interpreted = [mosaic_config.fit(None, 4, n, row_bytes=4, weight_bytes=2, widest=2, backward=True,
                                     interpret=True) for n in (16384, 32768)]
    assert [(p.cluster, p.dw_spill) for p in interpreted] == [(1, 8192), (1, 0)]
    plan = mosaic_config.fit(None, 4096, 65536, row_bytes=4, weight_bytes=2, widest=2, backward=True)
    assert plan.cluster == 8 and plan.width == 8192 and len(plan.chunks()) == 8
    tails = mosaic_config.fit(MosaicConfig(cluster=1), 8, 1152, row_bytes=2, weight_bytes=2, widest=2,
                              backward=False).chunks()
    assert tails == [(0, 1024), (1024, 128)]


def test_dweight_spill(monkeypatch):
    """The backward's ``dweight`` partial beyond ``DW_REGS`` per thread accumulates in shared memory (rows of 262144
    columns on the GPU; here ``DW_REGS`` is lowered so that a 1536-column row spills, and one CTA per row is forced:
    on Hopper the heuristic would split the row over a cluster instead). The broken variant, a spilled chunk that
    never accumulates, is caught by the same check."""
    from pallas_norm import mosaic_kernels

    monkeypatch.setattr(mosaic_config, "DW_REGS", 4)  # 512 columns in registers, the rest in shared memory
    config = MosaicConfig(cluster=1)
    plan = mosaic_config.fit(config, 37, 1536, row_bytes=4, weight_bytes=2, widest=2, backward=True,
                             interpret=not ON_HOPPER)
    assert plan.dw_spill == 1024
    x, w, dy = jax_inputs((37, 1536), jnp.bfloat16, 1.0, seed=13)
    jax.clear_caches()
    try:
        check_jax(x, w, dy, MOSAIC, casting="gemma", offset=1.0, bwd_config=config)
        monkeypatch.setattr(mosaic_kernels, "_spilled_add", lambda dw_s, off, size, terms: None)
        jax.clear_caches()
        assert judge(x, w, dy, jax_vjp(MOSAIC, x, w, dy, bwd_config=config))
    finally:
        jax.clear_caches()  # no later test may find these traces


def test_backward_reads_dy_again_where_holding_it_would_spill(monkeypatch):
    """A holding backward keeps ``x`` and ``g`` in registers but reads ``dy`` again for the ``dweight`` terms once a
    share reaches ``DW_REGS · THREADS`` columns (8192 on the GPU, where holding ``dy`` too spilled registers);
    here ``DW_REGS`` is lowered so that a 1536-column share reaches it. Held to the float64 rule, and to the bits
    of the same kernel holding ``dy``: the value read again is the one held."""
    from pallas_norm import mosaic_kernels

    monkeypatch.setattr(mosaic_config, "DW_REGS", 12)  # 1536 columns: the partial still fits, dy is read again
    config = MosaicConfig(block_rows=2, stages=2, hold=True)
    plan = mosaic_config.fit(config, 37, 1536, row_bytes=4, weight_bytes=2, widest=2, backward=True, interpret=True)
    assert plan.hold and plan.dw_spill == 0 and not mosaic_config.holds_dy(plan)
    x, w, dy = jax_inputs((37, 1536), jnp.bfloat16, 0.0, seed=17)
    jax.clear_caches()
    try:
        check_jax(x, w, dy, MOSAIC, config=config, bwd_config=config)
        read_again = jax_vjp(MOSAIC, x, w, dy, config=config, bwd_config=config)
        monkeypatch.setattr(mosaic_kernels, "holds_dy", lambda plan: True)
        jax.clear_caches()
        held = jax_vjp(MOSAIC, x, w, dy, config=config, bwd_config=config)
        for a, b in zip(read_again, held):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    finally:
        jax.clear_caches()


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("m,n,casting,offset", [
    (32768, 4096, "llama", 0.0), (65536, 2304, "gemma", 1.0), (4096, 65536, "llama", 0.0),
    (2048, 131072, "gemma", 1.0), (1024, 262144, "llama", 0.0),
    (4099, 1000, "none", 0.0), (7, 7, "llama", 1.0)])
def test_gpu_large_shapes(m, n, casting, offset):
    x, w, dy = jax_inputs((m, n), jnp.bfloat16, offset, seed=m + n)
    check_jax(x, w, dy, "mosaic", offset=offset, casting=casting)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("m,n", [(2048, 131072), (1024, 262144)])
def test_gpu_longest_rows_forward(m, n):
    """The longest rows' forward on clusters of 16 (one stage; 4 and 2 CTAs per SM, the latter holding its 16384
    columns in registers between the two walks) against the Triton lowering."""
    x, w, dy = jax_inputs((m, n), jnp.bfloat16, 1.0, seed=5)
    y, rstd = pn.rms_norm_with_rstd(x, w, impl="mosaic", casting="gemma", offset=1.0)
    y_ref, rstd_ref = pn.rms_norm_with_rstd(x, w, impl="pallas", casting="gemma", offset=1.0)
    np.testing.assert_allclose(np.asarray(rstd), np.asarray(rstd_ref), rtol=2e-6)
    diff = np.abs(np.asarray(y, np.float32) - np.asarray(y_ref, np.float32))
    assert float(diff.max()) <= 2 ** -6 * float(np.abs(np.asarray(y_ref, np.float32)).max())


@pytest.mark.gpu
@hopper
def test_gpu_stages_change_no_bits():
    """The staging depth changes when blocks arrive, not which CTA sums which rows: the backward with 3 or 4 stages
    (4096×2304, where the heuristic takes 4) gives the same dx and dweight bits. Negative control: 3 CTAs per SM
    instead of 2 (other rows per CTA) changes dweight's bits."""
    x, w, dy = jax_inputs((4096, 2304), jnp.bfloat16, 0.0, seed=9)

    def grads(config):
        return [np.asarray(g) for g in jax_vjp("mosaic", x, w, dy, bwd_config=config)[1:]]

    four = grads(MosaicConfig(stages=4, programs_per_sm=2))
    for got, want in zip(grads(MosaicConfig(stages=3, programs_per_sm=2)), four):
        np.testing.assert_array_equal(got, want)
    assert not np.array_equal(grads(MosaicConfig(stages=4, programs_per_sm=3))[1], four[1])


@pytest.mark.parametrize("capable", [True, False])
def test_auto_table(monkeypatch, capable):
    """``impl="auto"``'s lowering per direction and row length (``pallas_norm/auto.py``): Mosaic GPU only on Hopper
    and rows of 128·k columns; the backward from 1024 to 131072 columns (per-head rows of 128 stay on the Triton
    lowering, where Mosaic GPU ran at a third of its speed; 262144 too: column bands) but rows of at most 8192 that
    fill more than 3/4 of their padded length (the Triton lowering's resident backward is faster there) and rows of
    2304 (held as their pieces, ``auto.TRITON_BWD_PIECES``), the forward
    for 16384 < N ≤ 131072 (262144: column bands). Without ``triton_ffi``, which takes rows of 32768 where it is
    available (``tests/test_triton_ffi.py``)."""
    from pallas_norm import auto, triton_ffi

    monkeypatch.setattr(backend, "mosaic_capable", lambda: capable)
    monkeypatch.setattr(triton_ffi, "available", lambda: False)
    mosaic_bwd = {1280, 2560, 3072, 5120, 6144, 12288, 16384, 32768, 65536, 131072}
    mosaic_fwd = {32768, 65536, 131072}
    for n in (64, 128, 256, 1000, 1024, 1280, 2048, 2304, 2560, 3072, 3584, 4096, 5120, 6144, 7168, 8192, 12288, 16384,
              32768, 65536, 131072, 262144):
        assert auto.lowering(True, n) == ("mosaic" if capable and n in mosaic_bwd else "pallas"), n
        assert auto.lowering(False, n) == ("mosaic" if capable and n in mosaic_fwd else "pallas"), n
    assert auto.lowering(True, 128, MosaicConfig()) == "mosaic"  # a config picks its lowering
    # a backward small enough for one program takes the Triton lowering (one launch), a larger one the table's
    assert auto.lowering(True, 5120, m=12) == "pallas"
    assert auto.lowering(True, 5120, m=13) == ("mosaic" if capable else "pallas")
    assert auto.lowering(False, 32768, pn.Config(block_rows=1, block_cols=4096, num_warps=8)) == "pallas"


LOWERINGS = [((37, 1536), jnp.bfloat16, None), ((515, 8192), jnp.float16, MosaicConfig(block_rows=2, cluster=2)),
             ((515, 8192), jnp.bfloat16, MosaicConfig(block_rows=2, cluster=2, hold=True)),
             ((64, 65536), jnp.bfloat16, None), ((33000, 4096), jnp.float32, None), ((9, 1000), jnp.bfloat16, None),
             ((16, 262144), jnp.bfloat16, None), ((37, 1536), jnp.bfloat16, MosaicConfig(direct=False))]


@pytest.mark.parametrize("shape,dtype,config", LOWERINGS, ids=str)
def test_lowers_for_hopper(monkeypatch, shape, dtype, config):
    """The compiled kernels' Mosaic lowering, run on CPU for a Hopper target (no GPU needed): layouts, TMA copies,
    clusters and loops that the interpreter never lowers (it once let through an unroll the lowering refuses)."""
    x, w, dy = (jax.ShapeDtypeStruct(s, dtype) for s in (shape, shape[-1:], shape))

    def fwd_bwd(x, w, dy):
        y, vjp = jax.vjp(lambda x, w: pn.rms_norm(x, w, impl="mosaic", config=config, bwd_config=config), x, w)
        return y, vjp(dy)

    monkeypatch.setattr(backend, "mosaic_capable", lambda: True)
    monkeypatch.setattr(backend, "num_sms", lambda: 132)
    text = jax.jit(fwd_bwd).trace(x, w, dy).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu_v2") == 3  # forward, backward, dweight reduction
