"""The Pallas resident backward keeping dweight's terms per tile row (``kernels.DW_PER_ROW``: the tile's rows summed
once after the loop, not every row block), on CPU under the interpreter and compiled on the GPU (both launches): the
float64 rule, plain and the fused add's (whose dweight stays ``rms_norm``'s bits); the per-row path really runs (a
float32 weight's dweight bits differ from the per-block sum's). Broken variant: one tile row's terms lost, which the
rule catches."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import pytest

from pallas_norm import kernels, pallas_config, rowmath, triton_ffi

from helpers import KERNEL, bits, jax_inputs, judge

# (rows, columns): tiles of several rows, each program walking several row blocks (CPU: the interpreter's 8 "SMs").
CPU_SHAPES = [(4096, 64), (2048, 128), (1024, 256), (512, 512)]


def _run(x, w, dy, config, *, interpret: bool, dh=None):
    """``(y, dx or dh, dweight)``: the forward's y and rstd, then the backward on ``config``."""
    m, n = x.shape
    fwd = pallas_config.heuristic(m, n, backward=False)
    y, rstd = kernels.forward(x, w, eps=1e-6, offset=0.0, casting="llama", config=fwd, interpret=interpret)
    dx, dweight = kernels.backward(x, w, dy, rstd, offset=0.0, casting="llama", config=config, interpret=interpret,
                                   dh_out=dh)
    return y, dx, dweight


def _check(shape, monkeypatch, *, interpret: bool, launches=(False,)) -> None:
    m, n = shape
    x, w, dy = jax_inputs(shape, jnp.bfloat16, 0.0, seed=n, weight_dtype=jnp.float32)
    dh = jax_inputs(shape, jnp.bfloat16, 0.0, seed=n + 1)[2]
    base = pallas_config.heuristic(m, n, backward=True)
    assert base.block_rows > 1 and pallas_config.cdiv(pallas_config.cdiv(m, base.block_rows), base.programs) > 1
    monkeypatch.setattr(kernels, "DW_PER_ROW", frozenset())
    per_block = _run(x, w, dy, base, interpret=interpret)[2]
    monkeypatch.setattr(kernels, "DW_PER_ROW", frozenset({n}))
    for ffi in launches:
        config = dataclasses.replace(base, ffi_launch=ffi)
        plain = _run(x, w, dy, config, interpret=interpret)
        fused = _run(x, w, dy, config, interpret=interpret, dh=dh)
        assert judge(x, w, dy, plain) == []
        assert judge(x, w, dy, fused, dh_out=dh) == []
        assert (bits(fused[2]) == bits(plain[2])).all()
        assert not (bits(plain[2]) == bits(per_block)).all()  # the per-row path ran: another order of sums


@pytest.mark.parametrize("shape", CPU_SHAPES, ids=str)
def test_per_row_dweight_passes_the_rule(shape, monkeypatch):
    if KERNEL != "interpret":
        pytest.skip("the CPU interpreter's test; the GPU runs test_gpu_per_row_dweight_passes_the_rule")
    _check(shape, monkeypatch, interpret=True)


def test_a_lost_tile_row_is_caught(monkeypatch):
    """The broken variant: the last row of every tile's dweight terms dropped (under the per-row accumulator)."""
    if KERNEL != "interpret":
        pytest.skip("the CPU interpreter's test")
    shape = CPU_SHAPES[-1]
    x, w, dy = jax_inputs(shape, jnp.bfloat16, 0.0, seed=3, weight_dtype=jnp.float32)
    terms = rowmath.dweight_terms
    monkeypatch.setattr(kernels, "DW_PER_ROW", frozenset({shape[1]}))
    with monkeypatch.context() as patch:  # the kernel's only: the float64 reference uses rowmath too
        patch.setattr(kernels.rowmath, "dweight_terms", lambda d, nrm: terms(d, nrm).at[-1].set(0.0))
        lost = _run(x, w, dy, pallas_config.heuristic(*shape, backward=True), interpret=True)
    assert judge(x, w, dy, lost) != []


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(262144, 64), (131072, 128), (65536, 256), (65536, 512)], ids=str)
def test_gpu_per_row_dweight_passes_the_rule(shape, monkeypatch):
    """Compiled, launched by XLA and by jaxlib's Triton call (where available)."""
    launches = (False, True) if triton_ffi.available() else (False,)
    _check(shape, monkeypatch, interpret=False, launches=launches)
