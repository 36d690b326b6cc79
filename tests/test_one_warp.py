"""The resident forward on one-warp programs (``tile_tables.FWD_ONE_WARP``, ``pallas_config.one_warp_forward``):
where the heuristic takes it, and on a GPU that takes it the bits it must keep (the fused add's y and rstd are
``rms_norm(h)``'s; the torch launch route's are JAX's)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_norm import api, backend, pallas_config

from helpers import bits, jax_inputs

gpu = pytest.mark.gpu


def tiles(m: int, n: int, itemsize: int = 2, low: bool = True) -> tuple[tuple[int, int], tuple[int, int]]:
    """(block_rows, warps) of the plain forward's and the fused add's heuristic configs (``low``: the weight's product
    in the row's dtype)."""
    return tuple((c.block_rows, c.num_warps) for f in (False, True)
                 for c in [pallas_config.heuristic(m, n, backward=False, fused=f, itemsize=itemsize,
                                                   product_in_dtype=low)])


def test_h200_runs_many_rows_of_3584_on_one_warp_programs(monkeypatch):
    """On an H200 (132 SMs), 16-bit rows of 3584 columns from 96 rows per SM (12672) take a row per one-warp program,
    the plain forward and the fused add's alike (a row's sum is reduced in an order set by the warps); fewer rows,
    other widths, 32-bit rows, Gemma's float32 product and the H100 keep today's tiles. The table's key is what an
    H200 reports."""
    monkeypatch.setattr(backend, "num_sms", lambda: 132)
    h100 = {(m, n, s, low): tiles(m, n, s, low) for m in (4096, 12671, 12672, 32768) for n in (2304, 3584, 4096)
            for s in (2, 4) for low in (True, False)}
    assert h100[(32768, 3584, 2, True)] == h100[(32768, 3584, 2, False)] == ((2, 16), (1, 16))
    monkeypatch.setattr(backend, "gpu_model", lambda: "h200")
    for (m, n, s, low), today in h100.items():
        expected = ((1, 1), (1, 1)) if (n, s, low) == (3584, 2, True) and m >= 12672 else today
        assert tiles(m, n, s, low) == expected, (m, n, s, low)
    assert backend.model_slug("NVIDIA H200") in pallas_config.FWD_ONE_WARP
    assert backend.model_slug("NVIDIA H100 80GB HBM3") not in pallas_config.FWD_ONE_WARP


@gpu
def test_gpu_one_warp_fused_add_keeps_rms_norm_s_bits_and_torch_s():
    """Where this GPU runs the forward of 16384×3584 on one-warp programs: the fused add's y and rstd are
    ``rms_norm(h)``'s bits, and the torch launch route's y (plain and fused) JAX's. Broken variant: the fused add on
    its former tile (one row on 16 warps), whose rstd bits differ from the one-warp ``rms_norm(h)``'s."""
    import torch_bridge
    from torch_bridge.numpy_io import from_numpy

    m, n = 16384, 3584
    if not pallas_config.one_warp_forward(m, n):
        pytest.skip("this GPU model runs today's tiles here (tile_tables.FWD_ONE_WARP)")
    x, w, _ = jax_inputs((m, n), jnp.bfloat16, seed=31)
    r = jax_inputs((m, n), jnp.bfloat16, seed=32)[0]
    plain, fused = (pallas_config.heuristic(m, n, backward=False, fused=f) for f in (False, True))
    assert plain.num_warps == fused.num_warps == 1
    y, h, rstd = api.forward_fn(1e-6, 0.0, "llama", "auto", None, jnp.bfloat16)(x, r, w)
    y_h, rstd_h = api.forward_fn(1e-6, 0.0, "llama", "auto")(h, w)
    np.testing.assert_array_equal(bits(rstd), bits(rstd_h))
    np.testing.assert_array_equal(bits(y), bits(y_h))
    tx, tr, tw, th = (from_numpy(np.asarray(a), "cuda") for a in (x, r, w, h))
    np.testing.assert_array_equal(bits(torch_bridge.rms_norm(th, tw, backend="pallas_launch")), bits(y_h))
    ty, t_h = torch_bridge.rms_norm_add(tx, tr, tw, backend="pallas_launch")
    np.testing.assert_array_equal(bits(t_h), bits(h))
    np.testing.assert_array_equal(bits(ty), bits(y))
    sixteen = dataclasses.replace(fused, num_warps=16)
    rstd_16 = api.forward_fn(1e-6, 0.0, "llama", "pallas", sixteen, jnp.bfloat16)(x, r, w)[2]
    assert not np.array_equal(bits(rstd_16), bits(rstd_h))
