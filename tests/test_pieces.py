"""The resident backward on rows held as their power-of-two pieces (``Config.pieces``, ``pallas_config.BWD_PIECES``):
the accuracy rule in every mode, the fused add's dweight bits, the heuristic and where a config may ask for it."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import pallas_norm as pn
from pallas_norm import auto, backend, kernels, pallas_config, triton_ffi
from pallas_norm.pallas_config import Config, pieces_of

from helpers import GPU_KERNELS, KERNEL, assert_same_bits, check_jax, jax_inputs

PIECES = Config(1, 4096, 4, programs=5, pieces=True)  # 2304 = 2048 + 256: 5 programs walk 37 rows


@given(st.integers(1, 1 << 20))
def test_pieces_of_are_the_binary_digits(n):
    pieces = pieces_of(n)
    assert sum(pieces) == n and pieces == sorted(set(pieces), reverse=True)
    assert all(p & (p - 1) == 0 for p in pieces)


@pytest.mark.parametrize("shape,config,dtype,casting,offset,weight", [
    ((37, 2304), PIECES, jnp.bfloat16, "llama", 0.0, True),
    ((37, 2304), Config(2, 4096, 4, programs=3, prefetch=True, pieces=True), jnp.float16, "gemma", 1.0, True),
    ((21, 1000), Config(2, 1024, 4, programs=3, pieces=True, reload_weight=True), jnp.float32, "none", 0.0, True),
    ((21, 1000), Config(1, 1024, 2, programs=4, pieces=True), jnp.bfloat16, "llama", 0.0, False),
    ((9, 320), Config(1, 512, 2, programs=1, pieces=True), jnp.bfloat16, "gemma", 1.0, True),  # stores dweight
])
def test_pieces_backward_accuracy(shape, config, dtype, casting, offset, weight):
    """The pieces (2304: 2048 + 256; 1000: six of them; 320: 256 + 64) against the float64 reference, in every
    casting mode and dtype, with and without a weight, prefetching or reloading the weight, one program storing
    dweight itself."""
    x, w, dy = jax_inputs(shape, dtype, offset, seed=shape[1])
    check_jax(x, w if weight else None, dy, "interpret", offset=offset, casting=casting, bwd_config=config)


def test_a_dropped_piece_is_caught(monkeypatch):
    """Broken variant: a kernel that leaves the row's last piece out (of the row sum, dx and dweight) fails the
    accuracy rule (a shape of its own: the kernels are cached per shape)."""
    x, w, dy = jax_inputs((35, 2304), jnp.bfloat16, 0.0, seed=1)
    monkeypatch.setattr(kernels, "pieces_of", lambda n: pieces_of(n)[:-1])
    with pytest.raises(AssertionError):
        check_jax(x, w, dy, "interpret", bwd_config=PIECES)


def _dweights(x, r, w, dy, dh, impl, config):
    """``dweight`` of ``rms_norm(h)`` and of ``rms_norm_add(x, r)`` (h = x + r) under one backward config."""
    h = (x.astype(jnp.float32) + r.astype(jnp.float32)).astype(x.dtype)
    plain = jax.vjp(lambda b: pn.rms_norm(h, b, impl=impl, bwd_config=config), w)[1](dy)[0]
    fused = jax.vjp(lambda b: pn.rms_norm_add(x, r, b, impl=impl, bwd_config=config), w)[1]((dy, dh))[0]
    return plain, fused


def test_fused_add_dweight_is_rms_norm_s_bits():
    """The fused add's backward (which also reads dh_out) shares the pieces and the grid: its dweight is
    ``rms_norm(h)``'s bits (a float32 weight: its dweight shows every float32 rounding). Broken variant: a grid of 4
    programs splits the rows into other partials (other bits)."""
    x, w, dy = jax_inputs((37, 2304), jnp.bfloat16, 0.0, seed=5, weight_dtype=jnp.float32)
    r, _, dh = jax_inputs((37, 2304), jnp.bfloat16, 0.0, seed=6)
    plain, fused = _dweights(x, r, w, dy, dh, "interpret", PIECES)
    assert_same_bits(fused, plain)
    other = _dweights(x, r, w, dy, dh, "interpret", Config(1, 4096, 4, programs=4, pieces=True))[1]
    assert not np.array_equal(np.asarray(other, np.float32), np.asarray(plain, np.float32))


def test_heuristic_takes_pieces_at_the_table_s_widths(monkeypatch):
    """``BWD_PIECES``' widths (2304, 2560, 5120) take one-row programs of pieces at the table's tile, also for one
    program; halves of a power of two (1536, 3072, 6144), powers of two and other widths keep the padded tile;
    ``auto`` takes the Triton lowering's backward at 2304 (``TRITON_BWD_PIECES``), Mosaic GPU at 2560 and 5120.
    Launched by XLA (``tests/test_triton_ffi.py`` has jaxlib's launch)."""
    monkeypatch.setattr(backend, "num_sms", lambda: 132)
    monkeypatch.setattr(triton_ffi, "available", lambda: False)
    tiles = {(m, n): (c.block_rows, c.num_warps, c.programs, c.prefetch) for m, n in ((4096, 2304), (32768, 2560),
                                                                                      (32768, 5120), (12, 5120))
             for c in [pallas_config.heuristic(m, n, backward=True)] if c.pieces}
    assert tiles == {(4096, 2304): (1, 4, 528, False), (32768, 2560): (1, 8, 264, True),
                     (32768, 5120): (1, 4, 264, False), (12, 5120): (1, 4, 1, False)}
    for n in (1536, 3072, 6144, 2048, 4096, 2300, 1000, 3584, 16384):
        assert not pallas_config.heuristic(4096, n, backward=True).pieces, n
    monkeypatch.setattr(backend, "mosaic_capable", lambda: True)
    assert [auto.lowering(True, n) for n in (2304, 2560, 5120)] == ["pallas", "mosaic", "mosaic"]


def _shares_grid(plain: Config, fused: Config) -> bool:
    """What keeps dweight's bits between two backward tiles: the programs and the rows each takes at a time."""
    return (plain.programs, plain.block_rows, plain.block_cols, plain.pieces) == (
        fused.programs, fused.block_rows, fused.block_cols, fused.pieces)


def test_plain_backward_takes_its_own_tile_on_the_fused_add_s_grid(monkeypatch):
    """Where jaxlib launches the pieces, ``rms_norm``'s backward takes ``BWD_FFI_PIECES_PLAIN``'s warps and prefetch
    (5120: 4 warps, prefetching; 2304: prefetching up to 32 rows per program) on the fused add's grid, so dweight
    keeps the fused add's bits: shown under the interpreter, where prefetching moves the loads (the GPU's bits:
    ``test_triton_ffi.py``). Broken variant: a plain tile on half the programs fails both checks."""
    monkeypatch.setattr(backend, "num_sms", lambda: 132)
    monkeypatch.setattr(triton_ffi, "available", lambda: True)
    shapes = ((4096, 5120), (32768, 5120), (4096, 2304), (16896, 2304), (16897, 2304), (4096, 2560))
    configs = {s: [pallas_config.heuristic(*s, backward=True, fused=f) for f in (False, True)] for s in shapes}
    tiles = {s: tuple((c.num_warps, c.prefetch) for c in pair) for s, pair in configs.items()}
    assert tiles == {(4096, 5120): ((4, True), (8, False)), (32768, 5120): ((4, True), (8, False)),
                     (4096, 2304): ((4, True), (4, False)), (16896, 2304): ((4, True), (4, False)),
                     (16897, 2304): ((4, False), (4, False)), (4096, 2560): ((4, False), (4, False))}
    assert all(_shares_grid(*pair) for pair in configs.values())
    monkeypatch.setattr(backend, "num_sms", lambda: 4)  # a few rows per program under the interpreter
    for shape in ((40, 5120), (45, 2304)):
        plain_cfg, fused_cfg = (pallas_config.fit(None, *shape, backward=True, fused=f) for f in (False, True))
        assert plain_cfg.prefetch and not fused_cfg.prefetch and plain_cfg.programs < shape[0]
        x, w, dy = jax_inputs(shape, jnp.bfloat16, 0.0, seed=7, weight_dtype=jnp.float32)
        r, _, dh = jax_inputs(shape, jnp.bfloat16, 0.0, seed=8)
        plain, fused = _dweights(x, r, w, dy, dh, "interpret", None)
        assert_same_bits(fused, plain)
    broken = dataclasses.replace(plain_cfg, programs=plain_cfg.programs // 2)
    assert not _shares_grid(broken, fused_cfg)
    h = (x.astype(jnp.float32) + r.astype(jnp.float32)).astype(x.dtype)
    other = jax.vjp(lambda b: pn.rms_norm(h, b, impl="interpret", bwd_config=broken), w)[1](dy)[0]
    assert not np.array_equal(np.asarray(other), np.asarray(fused))


def test_h200_backward_of_2304_and_2560_prefetches_at_every_row_count(monkeypatch):
    """``BWD_FFI_PIECES_PLAIN_BY_MODEL``: on an H200 ``rms_norm``'s backward of rows of 2304 and 2560 prefetches
    however many rows each program takes (the H100's table stops at 32 rows of 2304 and never prefetches 2560), on
    the fused add's grid; the fused add's tile (``BWD_FFI_PIECES_BY_MODEL``) prefetches on 2 warps at 2304 and stays
    unprefetched at 2560; 5120 keeps the H100's tile. Broken variant: the H100's tables."""
    monkeypatch.setattr(backend, "num_sms", lambda: 132)
    monkeypatch.setattr(triton_ffi, "available", lambda: True)
    shapes = [(m, n) for m in (4096, 16897, 32768, 65536) for n in (2304, 2560, 5120)]

    def tiles() -> dict:
        configs = {s: [pallas_config.heuristic(*s, backward=True, fused=f) for f in (False, True)] for s in shapes}
        assert all(_shares_grid(*pair) for pair in configs.values())
        return {s: tuple((c.num_warps, c.prefetch) for c in pair) for s, pair in configs.items()}

    h100 = tiles()
    assert h100[(32768, 2304)] == ((4, False), (4, False))
    monkeypatch.setattr(backend, "gpu_model", lambda: "h200")
    h200 = tiles()
    assert {s for s in shapes if h200[s] != h100[s]} == {(m, n) for m in (4096, 16897, 32768, 65536)
                                                         for n in (2304, 2560)}
    assert {h200[(m, 2304)] for m in (4096, 16897, 32768, 65536)} == {((4, True), (2, True))}
    assert {h200[(m, 2560)] for m in (4096, 16897, 32768, 65536)} == {((4, True), (4, False))}


def test_pieces_only_tile_the_resident_backward():
    """A config asking for pieces where they do not apply (the forward; a backward walking column chunks) is refused
    with the reason, not ignored."""
    with pytest.raises(ValueError, match="pieces is an option of the backward"):
        pallas_config.fit(PIECES, 37, 2304, backward=False)
    with pytest.raises(ValueError, match="pieces is an option of the backward"):
        pallas_config.fit(Config(1, 1024, 4, programs=4, pieces=True), 37, 2304, backward=True)
    with pytest.raises(ValueError, match="pieces must be a bool"):
        Config(1, 1024, 4, pieces=1)
    x, w, dy = jax_inputs((3, 2304), jnp.bfloat16)
    with pytest.raises(ValueError, match="pieces is an option of the backward"):
        pn.rms_norm(x, w, impl="interpret", config=PIECES)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,casting,offset", [(4096, 2304, "llama", 0.0), (1000, 5120, "gemma", 1.0),
                                                (4099, 2560, "none", 0.0), (8, 2304, "llama", 0.0),
                                                (33000, 2304, "gemma", 1.0),
                                                (5000, 2560, "llama", 0.0)])
def test_gpu_pieces(m, n, casting, offset):
    """The compiled heuristic (pieces at these widths, one program at 8 rows; on an H200 the plain backward
    prefetches on 4 warps, the fused add's on 2 at 2304 and not at 2560) against the float64 reference; dweight the
    same bits over repeated calls and the fused add's the same as ``rms_norm(h)``'s."""
    assert pallas_config.heuristic(m, n, backward=True).pieces
    x, w, dy = jax_inputs((m, n), jnp.bfloat16, offset, seed=m + n, weight_dtype=jnp.float32)
    check_jax(x, w, dy, KERNEL, offset=offset, casting=casting)
    r, _, dh = jax_inputs((m, n), jnp.bfloat16, offset, seed=m + n + 1)
    plain, fused = _dweights(x, r, w, dy, dh, GPU_KERNELS[0], None)
    assert_same_bits(fused, plain)
    assert_same_bits(_dweights(x, r, w, dy, dh, GPU_KERNELS[0], None)[0], plain)
