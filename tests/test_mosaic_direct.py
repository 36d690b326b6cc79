"""Mosaic GPU's direct forward (``MosaicConfig.direct``, the default for rows one CTA holds): rows loaded from
global memory straight into registers, nothing staged. It must give the staged kernel's bits (the same chunks, the
same sums) and meet the float64 rule; its config and heuristic rules; on the GPU too."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_norm as pn
from pallas_norm import backend, mosaic_config
from pallas_norm.mosaic_config import MosaicConfig

from helpers import MOSAIC, bits, check_jax, hopper, jax_inputs



DIRECT_CASES = [((37, 384), jnp.bfloat16, "llama", 0.0, 2, None), ((8, 1024), jnp.float16, "gemma", 1.0, 1, None),
                ((5, 200), jnp.float32, "none", 0.0, 4, None), ((9, 640), jnp.bfloat16, "llama", 0.0, 2, jnp.float32)]


def _forward_bits(x, r, w, impl, config, residual_dtype=None, **kw):
    """Bits of ``(y, rstd)`` and of the fused add's ``(y, h)`` (``r`` the residual), with and without the weight."""
    outs = [*pn.rms_norm_with_rstd(x, w, impl=impl, config=config, **kw),
            *pn.rms_norm_add(x, r, w, residual_dtype=residual_dtype, impl=impl, config=config, **kw),
            pn.rms_norm(x, None, impl=impl, config=config, eps=kw["eps"], casting=kw["casting"])]
    return [bits(o) for o in outs]


@pytest.mark.parametrize("shape,dtype,casting,offset,rows,residual_dtype", DIRECT_CASES, ids=str)
def test_direct_forward_gives_the_staged_bits(shape, dtype, casting, offset, rows, residual_dtype):
    """The direct forward (rows loaded from global memory into registers, nothing staged) sums the staged kernel's
    chunks in their order: the same y, rstd and fused-add y and h bits (an fp32 residual stream too, no weight too,
    ragged last blocks), and the float64 rule (forward and backward)."""
    x, w, dy = jax_inputs(shape, dtype, offset, seed=shape[1])
    r = jax_inputs(shape, residual_dtype or dtype, 0.0, seed=shape[1] + 1)[0]
    kw = dict(eps=1e-6, offset=offset, casting=casting)
    direct = MosaicConfig(block_rows=rows, direct=True)
    assert mosaic_config.fit(direct, *shape, row_bytes=2, weight_bytes=2, widest=2, backward=False).direct
    want = _forward_bits(x, r, w, MOSAIC, MosaicConfig(block_rows=rows, direct=False), residual_dtype, **kw)
    for got, ref in zip(_forward_bits(x, r, w, MOSAIC, direct, residual_dtype, **kw), want):
        np.testing.assert_array_equal(got, ref)
    check_jax(x, w, dy, MOSAIC, config=direct, **kw)


def test_direct_bits_check_catches_other_chunks(monkeypatch):
    """Broken variant of the test above: a direct forward walking half-size chunks (another summation order) is
    caught (float32 rows, where rstd's last bit shows in y)."""
    x, w, _ = jax_inputs((64, 1024), jnp.float32, 0.0, seed=4)
    staged = bits(pn.rms_norm(x, w, impl=MOSAIC, config=MosaicConfig(direct=False)))
    chunks = mosaic_config.Plan.chunks

    def halves(plan):
        return [(o + h, s // 2) for o, s in chunks(plan) for h in (0, s // 2)] if plan.direct else chunks(plan)

    monkeypatch.setattr(mosaic_config.Plan, "chunks", halves)
    assert not np.array_equal(bits(pn.rms_norm(x, w, impl=MOSAIC, config=MosaicConfig(direct=True))), staged)


def test_direct_config_and_heuristic(monkeypatch):
    """The forward of rows one CTA holds (at most 16384 columns) runs direct by default, a CTA per block of
    ``block_rows`` rows; ``direct=False`` stages it; direct is refused for the backward, clusters and longer rows."""
    monkeypatch.setattr(backend, "num_sms", lambda: 132)
    fit = lambda cfg, m, n, backward=False: mosaic_config.fit(cfg, m, n, row_bytes=2, weight_bytes=2,  # noqa: E731
                                                              widest=2, backward=backward)
    for n in (64, 1000, 4096, 5120, 16384):
        plan = fit(None, 4099, n)
        assert plan.direct and plan.cluster == 1 and plan.programs == 4099 and plan.n_pad == -(-n // 128) * 128
    assert fit(MosaicConfig(block_rows=4), 4099, 4096).programs == 1025
    assert not fit(None, 4096, 32768).direct and not fit(None, 4096, 4096, backward=True).direct
    assert not fit(MosaicConfig(direct=False), 4096, 4096).direct
    with pytest.raises(ValueError, match="direct"):
        MosaicConfig(direct=1)
    refused = ((MosaicConfig(direct=True), 4096, True), (MosaicConfig(direct=True, cluster=2), 4096, False),
               (MosaicConfig(direct=True), 16385, False))
    for cfg, n, backward in refused:
        with pytest.raises(ValueError, match="direct is a forward option"):
            fit(cfg, 64, n, backward)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("m,n,dtype,casting,offset", [(4096, 1024, jnp.bfloat16, "llama", 0.0),
                                                      (1000, 5120, jnp.float16, "gemma", 1.0),
                                                      (300, 16384, jnp.bfloat16, "llama", 0.0)])
def test_gpu_direct_forward_gives_the_staged_bits(m, n, dtype, casting, offset):
    """On the GPU too (the compiled kernels' layouts and reductions): the direct forward's y, rstd and fused-add
    y and h are the staged forward's bits, and meet the float64 rule."""
    x, w, dy = jax_inputs((m, n), dtype, offset, seed=n)
    r = jax_inputs((m, n), dtype, 0.0, seed=n + 1)[0]
    kw = dict(eps=1e-6, offset=offset, casting=casting)
    want = _forward_bits(x, r, w, "mosaic", MosaicConfig(direct=False), **kw)
    for got, ref in zip(_forward_bits(x, r, w, "mosaic", None, **kw), want):
        np.testing.assert_array_equal(got, ref)
    check_jax(x, w, dy, "mosaic", **kw)
