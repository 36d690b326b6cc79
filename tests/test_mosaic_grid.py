"""The Mosaic GPU backward's grid (``pallas_norm.mosaic_config``): the fused add's backward on ``rms_norm``'s grid
(its ``dweight`` is ``rms_norm(h)``'s bits), and the per-GPU-model tiles of rows one CTA holds
(``BWD_BY_MODEL``, ``BWD_PER_SM_BY_MODEL``)."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_norm as pn
from pallas_norm import backend, mosaic_config
from pallas_norm.mosaic_config import MosaicConfig

from helpers import MOSAIC, check_jax, hopper, jax_inputs, jax_vjp


def _grid(plan) -> tuple:
    return plan.cluster, plan.block_rows, plan.programs, plan.per


def test_fused_add_backward_keeps_rms_norm_s_grid(monkeypatch):
    """The fused add's backward stages ``dh_out`` too (6 bytes per bf16 column against 4); it keeps ``rms_norm``'s
    cluster, rows per block and CTAs (each CTA sums the same rows' ``dweight`` terms) and gives up stages, then the
    weight's staging, to fit them. The broken variant, the fused add fitting its own grid, runs half the CTAs at
    16384×6144 (bf16) and 2/3 at 4096×65536."""
    monkeypatch.setattr(backend, "num_sms", lambda: 132)
    for (m, n), size in itertools.product(((32768, 1536), (16384, 6144), (8192, 12288), (4096, 65536),
                                           (2048, 131072), (1024, 262144)), (2, 4)):
        kw = dict(weight_bytes=size, widest=size, backward=True)
        plain = mosaic_config.fit(None, m, n, row_bytes=2 * size, **kw)
        if (n, size) == (262144, 4):  # float32: 12 bytes a column do not fit 16384 columns per CTA (nor did they)
            with pytest.raises(mosaic_config.Unsupported, match="fused add"):
                mosaic_config.fit(None, m, n, row_bytes=3 * size, grid_row_bytes=2 * size, **kw)
            continue
        fused = mosaic_config.fit(None, m, n, row_bytes=3 * size, grid_row_bytes=2 * size, **kw)
        assert _grid(fused) == _grid(plain) and fused.per_sm == plain.per_sm
        assert plain.per_sm * mosaic_config.smem_bytes(fused, 3 * size, size) <= mosaic_config.SMEM_BYTES
    own = [mosaic_config.fit(None, m, n, row_bytes=6, weight_bytes=2, widest=2, backward=True).programs
           for m, n in ((16384, 6144), (4096, 65536))]
    assert own == [132, 33]


def _fused_and_plain_dweights(shape, config=None, seed=19) -> tuple[np.ndarray, np.ndarray]:
    """``dweight`` of ``rms_norm_add`` and of ``rms_norm(h)`` on the Mosaic kernels (float32 weight: ``dweight``
    keeps its partial sums' bits)."""
    x, w, dy = jax_inputs(shape, jnp.bfloat16, 1.0, weight_dtype=jnp.float32, seed=seed)
    residual, dh_out = jnp.roll(x, 1, axis=0), jnp.roll(dy, 1, axis=1)
    kw = dict(casting="gemma", offset=1.0, bwd_config=config)
    (_, h), vjp = jax.vjp(lambda a, r, b: pn.rms_norm_add(a, r, b, impl=MOSAIC, **kw), x, residual, w)
    return np.asarray(vjp((dy, dh_out))[2]), np.asarray(jax_vjp(MOSAIC, h, w, dy, **kw)[2])


def _check_fused_add_bits(monkeypatch, shape, config=None) -> None:
    """Equal bits, then the broken variant (the fused add fitting its own grid) caught."""
    fit = mosaic_config.fit
    jax.clear_caches()
    try:
        np.testing.assert_array_equal(*_fused_and_plain_dweights(shape, config))
        monkeypatch.setattr(mosaic_config, "fit", lambda *a, grid_row_bytes=None, **k: fit(*a, **k))
        jax.clear_caches()
        assert not np.array_equal(*_fused_and_plain_dweights(shape, config))
    finally:
        jax.clear_caches()


def test_fused_add_dweight_is_rms_norm_s_bits(monkeypatch):
    """The fused add's ``dweight`` is ``rms_norm(h)``'s bits where its buffers fit fewer CTAs per SM than
    ``rms_norm``'s (shared memory lowered so that 2 CTAs of ``rms_norm``'s backward fit and 1 of the fused add's:
    the broken variant runs 8 CTAs instead of 16: 8 SMs pinned, as the interpreter has; on an H200's 132 both grids
    held all 37 rows, one CTA each, and the broken variant went uncaught)."""
    monkeypatch.setattr(backend, "num_sms", lambda: 8)
    monkeypatch.setattr(mosaic_config, "SMEM_BYTES", 48000)  # per CTA at 2 stages: 22528 bytes plain, 28672 fused
    _check_fused_add_bits(monkeypatch, (37, 1536), MosaicConfig(stages=2, programs_per_sm=2))


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("shape", [(16384, 6144), (4096, 65536)])
def test_gpu_fused_add_dweight_is_rms_norm_s_bits(monkeypatch, shape):
    """The same at the heuristic's grids where the fused add's buffers fit fewer CTAs per SM: 6144 columns (2 per
    SM against 1) and 65536 (clusters of 8, 3 per SM against 2)."""
    _check_fused_add_bits(monkeypatch, shape)


def test_h200_backward_tiles_of_padded_widths(monkeypatch):
    """On an H200 the backward of 16-bit rows of 1536 and 3072 columns runs 4 stages (``BWD_BY_MODEL``) and of more
    than 8192 and fewer than 16384 two CTAs per SM (``BWD_PER_SM_BY_MODEL``); float32 rows and other models keep the
    heuristic's (3 stages, one CTA per SM from 9216), so does 16384, and the fitted plan has what the table asks."""
    monkeypatch.setattr(backend, "num_sms", lambda: 132)
    widths = (1536, 3072, 8192, 9216, 10240, 12288, 14336, 16256, 16384)

    def tiles(itemsize):
        return [(c.stages, c.programs_per_sm) for c in (mosaic_config.heuristic(32768, n, backward=True,
                                                                                itemsize=itemsize) for n in widths)]

    monkeypatch.setattr(backend, "gpu_model", lambda: "h100")
    h100 = tiles(2)
    assert h100 == [(3, 2), (3, 2), (3, 2)] + [(3, 1)] * 6 and tiles(4) == h100
    monkeypatch.setattr(backend, "gpu_model", lambda: "h200")
    assert tiles(2) == [(4, 2), (4, 2), (3, 2)] + [(3, 2)] * 5 + [(3, 1)] and tiles(4) == h100
    plans = [mosaic_config.fit(None, 32768, n, row_bytes=4, weight_bytes=2, widest=2, backward=True) for n in widths]
    # 8192 and 16256: two CTAs' buffers do not fit an SM, ``fit`` keeps one
    assert [(p.stages, p.per_sm, p.cluster) for p in plans] == [(4, 2, 1), (4, 2, 1), (3, 1, 1)] + [(3, 2, 2)] * 4 + [
        (3, 1, 2)] * 2
    fused = mosaic_config.fit(None, 32768, 12288, row_bytes=6, weight_bytes=2, widest=2, backward=True,
                              grid_row_bytes=4)
    assert (fused.stages, fused.per_sm, fused.programs) == (2, 2, plans[5].programs)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("m,n", [(4096, 1536), (4097, 3072), (4096, 10240), (4096, 12288), (4095, 14336)])
def test_gpu_padded_widths(m, n):
    """The backward's heuristic tiles at widths Mosaic GPU keeps on an H200 (``BWD_BY_MODEL``, ``BWD_PER_SM_BY_MODEL``
    there): the float64 rule, and the fused add's ``dweight`` is ``rms_norm(h)``'s bits."""
    x, w, dy = jax_inputs((m, n), jnp.bfloat16, 1.0, seed=n)
    check_jax(x, w, dy, "mosaic", offset=1.0, casting="gemma")
    np.testing.assert_array_equal(*_fused_and_plain_dweights((m, n), seed=n))
