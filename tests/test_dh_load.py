"""The fused add's resident backward loading dh_out within its row block (``kernels.DH_LOAD``: "block" at its
start, "use" where dx adds it) instead of one block ahead with x and dy: the same values, so the same bits as the
prefetched load, under the CPU interpreter on a prefetching tile walking several blocks per program, and compiled
on the GPU. Broken variant: a wrong dh_out tile from the in-block load, which the bit comparison catches."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from pallas_norm import kernels, pallas_config, triton_ffi

from helpers import KERNEL, bits, jax_inputs

SHAPE = (1024, 512)  # 8-row tiles of 512, prefetching; each of the interpreter's programs walks several blocks


def _fused_backward(x, w, dy, dh, interpret=True, ffi=None):
    """The fused add's backward on the heuristic's tile (``ffi``: launched that way, None: the heuristic's)."""
    jax.clear_caches()  # the kernel reads DH_LOAD when traced
    m, n = x.shape
    config = pallas_config.heuristic(m, n, backward=True, fused=True)
    config = config if ffi is None else dataclasses.replace(config, ffi_launch=ffi)
    assert (config.prefetch or config.reload_weight) and pallas_config.cdiv(
        pallas_config.cdiv(m, config.block_rows), config.programs) > 1
    rstd = kernels.forward(x, w, eps=1e-6, offset=0.0, casting="llama",
                           config=pallas_config.heuristic(m, n, backward=False), interpret=interpret)[1]
    return kernels.backward(x, w, dy, rstd, offset=0.0, casting="llama", config=config, interpret=interpret,
                            dh_out=dh)


@pytest.mark.parametrize("where", ["block", "use"])
def test_dh_out_loaded_in_its_block_keeps_the_bits(where, monkeypatch):
    if KERNEL != "interpret":
        pytest.skip("the CPU interpreter's test")
    x, w, dy = jax_inputs(SHAPE, jnp.bfloat16, 0.0, seed=41)
    dh = jax_inputs(SHAPE, jnp.bfloat16, 0.0, seed=42)[2]
    monkeypatch.setattr(kernels, "DH_LOAD", {})
    prefetched = _fused_backward(x, w, dy, dh)
    monkeypatch.setattr(kernels, "DH_LOAD", {SHAPE[1]: where})
    in_block = _fused_backward(x, w, dy, dh)
    assert all((bits(a) == bits(b)).all() for a, b in zip(prefetched, in_block))
    tile = kernels._dh_tile
    monkeypatch.setattr(kernels, "_dh_tile", lambda *a: -tile(*a))  # the broken variant
    broken = _fused_backward(x, w, dy, dh)
    assert not (bits(broken[0]) == bits(prefetched[0])).all()


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(8192, 512), (65536, 512), (65536, 256), (4096, 16384)], ids=str)
@pytest.mark.parametrize("where", ["block", "use"])
def test_gpu_dh_out_loaded_in_its_block_keeps_the_bits(shape, where, monkeypatch):
    """Compiled, launched by XLA and by jaxlib's Triton call (where available; rows of 16384 held whole by it
    only)."""
    if shape[1] == 16384 and not triton_ffi.available():
        pytest.skip("rows of 16384 are held whole by jaxlib's launch only (column bands otherwise)")
    x, w, dy = jax_inputs(shape, jnp.bfloat16, 0.0, seed=41)
    dh = jax_inputs(shape, jnp.bfloat16, 0.0, seed=42)[2]
    launches = (None,) if shape[1] == 16384 else (False, True) if triton_ffi.available() else (False,)
    for ffi in launches:
        monkeypatch.setattr(kernels, "DH_LOAD", {})
        prefetched = _fused_backward(x, w, dy, dh, interpret=False, ffi=ffi)
        monkeypatch.setattr(kernels, "DH_LOAD", {shape[1]: where})
        in_block = _fused_backward(x, w, dy, dh, interpret=False, ffi=ffi)
        assert all((bits(a) == bits(b)).all() for a, b in zip(prefetched, in_block))
