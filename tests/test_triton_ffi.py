"""The resident forward and backward launched by jaxlib's Triton call (``pallas_norm.triton_ffi``,
``Config.ffi_launch``): the pinned rounding that keeps its bits assembler-independent, and on a GPU its results, its
use by ``impl=None`` and the torch launch route's bits. Where the heuristics take it: ``test_ffi_choice.py``."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import pallas_norm as pn
from pallas_norm import kernels, pallas_config, triton_ffi
from pallas_norm.pallas_config import Config

from helpers import bits, check_jax, h100_forward_ttir, hopper, jax_inputs, torch_inputs

PTX = """
    mul.f32 %f3, %f1, %f2;
    add.f32 %f4, %f3, %f0;
    add.ftz.f32 %f5, %f4, %f0;
    sub.f64 %fd2, %fd1, %fd0;
    fma.rn.f32 %f6, %f1, %f2, %f3;
    mul.rn.f32 %f7, %f1, %f2;
    mul.wide.s32 %rd1, %r1, 4;
    add.s64 %rd2, %rd1, %rd0;
"""


def test_pin_rounding_gives_every_float_mul_add_sub_a_rounding_mode():
    """What the assembler could contract into an FMA gets ``.rn``; integer ops, FMAs and rounded ops are kept.
    Broken variant: the unpinned text, which the same check finds contractible ops in."""
    pinned = triton_ffi.pin_rounding(PTX)
    for op in ("mul.rn.f32 %f3", "add.rn.f32 %f4", "add.rn.ftz.f32 %f5", "sub.rn.f64 %fd2", "fma.rn.f32 %f6",
               "mul.rn.f32 %f7", "mul.wide.s32", "add.s64"):
        assert op in pinned, op
    assert triton_ffi._UNROUNDED.search(pinned) is None
    assert triton_ffi._UNROUNDED.search(PTX) is not None


def test_the_forward_s_ptx_has_nothing_left_to_contract(monkeypatch):
    """The resident forward at 32768 columns, lowered for an (abstract) H100 and compiled by the triton package as
    ``triton_ffi`` compiles it: its PTX has unrounded float ops (the assembler's choice), the pinned PTX none."""
    pytest.importorskip("triton")
    ttir = h100_forward_ttir(monkeypatch, 8, 32768, Config(1, 32768, 16))
    ptx = triton_ffi.triton_binary(ttir, 90, 16, 3).asm["ptx"]
    assert triton_ffi._UNROUNDED.search(ptx) is not None
    pinned = triton_ffi.pin_rounding(ptx)
    assert triton_ffi._UNROUNDED.search(pinned) is None and pinned.count(".rn.f32") > ptx.count(".rn.f32")


gpu = pytest.mark.gpu


@gpu
@hopper
@pytest.mark.parametrize("shape,dtype,casting,offset", [((300, 32768), jnp.bfloat16, "llama", 0.0),
                                                        ((257, 30000), jnp.float16, "gemma", 1.0),
                                                        ((129, 16384), jnp.float32, "llama", 0.0),
                                                        ((64, 16000), jnp.bfloat16, "gemma", 1.0),
                                                        ((4096, 1024), jnp.bfloat16, "llama", 0.0),
                                                        ((3001, 1000), jnp.float16, "gemma", 1.0)], ids=str)
def test_gpu_impl_none_forward_runs_through_jaxlib_and_matches_float64_rule(shape, dtype, casting, offset):
    """The lowered forward holds the jaxlib call (no XLA-launched Triton kernel), and the results (the backward
    too, which stays as it was) meet the accuracy rule."""
    assert triton_ffi.available()
    x, w, dy = jax_inputs(shape, dtype, offset, seed=7)
    text = jax.jit(lambda a, b: pn.rms_norm(a, b, offset=offset, casting=casting)).lower(x, w).as_text()
    assert triton_ffi.FFI_TARGET in text and triton_ffi.XLA_TRITON_TARGET not in text
    check_jax(x, w, dy, impl=None, eps=1e-6, offset=offset, casting=casting)


@gpu
@hopper
@pytest.mark.parametrize("shape,dtype,casting,offset", [((4099, 4096), jnp.bfloat16, "llama", 0.0),
                                                        ((1000, 3584), jnp.float16, "gemma", 1.0),
                                                        ((300, 8192), jnp.float32, "none", 0.0),
                                                        ((5000, 2048), jnp.bfloat16, "gemma", 1.0),
                                                        ((3000, 5120), jnp.bfloat16, "llama", 0.0),
                                                        ((4099, 2560), jnp.float16, "gemma", 1.0),
                                                        ((5000, 2304), jnp.bfloat16, "gemma", 1.0),
                                                        ((3000, 1024), jnp.float32, "llama", 0.0),
                                                        ((70001, 64), jnp.float32, "llama", 0.0),
                                                        ((60001, 128), jnp.float16, "gemma", 1.0)], ids=str)
def test_gpu_backward_runs_through_jaxlib_and_matches_float64_rule(shape, dtype, casting, offset):
    """``impl=None``'s backward at ``BWD_FFI_RESIDENT``'s and ``BWD_FFI_PIECES``' widths holds the jaxlib call, meets
    the accuracy rule, and the fused add's dweight is ``rms_norm(h)``'s bits (both launched the same way)."""
    assert pallas_config.heuristic(*shape, backward=True).ffi_launch
    x, w, dy = jax_inputs(shape, dtype, offset, seed=9, weight_dtype=jnp.float32)
    mode = dict(eps=1e-6, offset=offset, casting=casting)
    bwd = jax.jit(lambda a, b, c: jax.vjp(lambda a, b: pn.rms_norm(a, b, **mode), a, b)[1](c))
    assert triton_ffi.FFI_TARGET in bwd.lower(x, w, dy).as_text()
    check_jax(x, w, dy, impl=None, **mode)
    r, _, dh = jax_inputs(shape, dtype, offset, seed=10)
    h = pn.rms_norm_add(x, r, w, **mode)[1]
    fused = jax.vjp(lambda b: pn.rms_norm_add(x, r, b, **mode), w)[1]((dy, dh))[0]
    np.testing.assert_array_equal(bits(fused), bits(bwd(h, w, dy)[1]))


@gpu
@hopper
@pytest.mark.parametrize("dtype,casting,offset", [(jnp.bfloat16, "llama", 0.0), (jnp.bfloat16, "gemma", 1.0),
                                                  (jnp.float16, "none", 0.0)], ids=str)
def test_gpu_held_16384_backward_runs_through_jaxlib_and_matches_float64_rule(dtype, casting, offset):
    """``impl="pallas"``'s backward of rows of 16384 (``BWD_FFI_HELD``: held on one program per SM, the weight
    reloaded) holds the jaxlib call, meets the accuracy rule, and the fused add's dweight is ``rms_norm(h)``'s
    bits (Gemma's on an H200 on the fused add's forward tile: its plain forward's two passes give another rstd);
    ``impl=None`` runs it at these few rows per SM (``auto.HELD_BWD_MAX_ROWS_PER_SM``): the same call, the same
    bits."""
    shape = (1000, 16384)
    config = pallas_config.heuristic(*shape, backward=True)
    assert config.ffi_launch and config.reload_weight and not config.lag
    x, w, dy = jax_inputs(shape, dtype, offset, seed=16)
    mode = dict(eps=1e-6, offset=offset, casting=casting)
    bwd = jax.jit(lambda a, b, c: jax.vjp(lambda a, b: pn.rms_norm(a, b, impl="pallas", **mode), a, b)[1](c))
    assert triton_ffi.FFI_TARGET in bwd.lower(x, w, dy).as_text()
    check_jax(x, w, dy, "pallas", **mode)
    auto = jax.jit(lambda a, b, c: jax.vjp(lambda a, b: pn.rms_norm(a, b, **mode), a, b)[1](c))
    assert triton_ffi.FFI_TARGET in auto.lower(x, w, dy).as_text()
    assert all((bits(p) == bits(q)).all() for p, q in zip(auto(x, w, dy), bwd(x, w, dy)))
    r, _, dh = jax_inputs(shape, dtype, offset, seed=17)
    h = pn.rms_norm_add(x, r, w, impl="pallas", **mode)[1]
    fused = jax.vjp(lambda b: pn.rms_norm_add(x, r, b, impl="pallas", **mode), w)[1]((dy, dh))[0]
    low = kernels.product_in_dtype(w.dtype, x.dtype, casting, offset)
    plain_fwd, fused_fwd = (pallas_config.heuristic(*shape, backward=False, fused=f, product_in_dtype=low)
                            for f in (False, True))
    if not plain_fwd.resident(shape[1]):  # Gemma's plain forward in two passes on an H200: rms_norm(h)'s rstd is
        # not the fused add's resident row's (FWD_FFI_TWO_PASS_PLAIN_BY_MODEL), so its dweight on the fused add's tile
        h_norm = jax.vjp(lambda b: pn.rms_norm(h, b, impl="pallas", config=fused_fwd, **mode), w)[1](dy)[0]
        np.testing.assert_array_equal(bits(fused), bits(h_norm))
        return
    np.testing.assert_array_equal(bits(fused), bits(bwd(h, w, dy)[1]))


@gpu
@hopper
def test_gpu_jaxlib_launched_pieces_hold_the_register_cap():
    """The fused add's pieces backward at 2560 columns (4 warps, 4 programs per SM, on the H100 and the H200) is
    assembled under ``.maxnreg 128`` (at 2304 the H100's tile took 135 registers unheld)."""
    x, w, dy = jax_inputs((5000, 2560), jnp.bfloat16, seed=13)
    r, _, dh = jax_inputs((5000, 2560), jnp.bfloat16, seed=14)
    config = pallas_config.heuristic(5000, 2560, backward=True, fused=True)
    assert config.ffi_launch and pallas_config.register_cap(config) == 128
    jax.block_until_ready(jax.vjp(pn.rms_norm_add, x, r, w)[1]((dy, dh)))
    capped = [c for c in triton_ffi._BY_OPAQUE.values() if c.grid[0] == config.programs and c.num_warps == 4]
    assert capped and all(".maxnreg 128" in c.ptx for c in capped)


@gpu
@hopper
def test_gpu_torch_launch_route_backward_gives_jax_bits():
    """``backend="pallas"``'s backward on CUDA tensors launches the jaxlib-launched kernel's PTX: JAX's dx and dweight
    bits, call after call; the XLA-launched kernel of the same tile agrees within a rounding of dx."""
    import torch_bridge
    from torch_bridge.numpy_io import autograd_outputs

    for shape in ((4096, 4096), (999, 8192), (257, 2048), (999, 5120), (513, 2560), (2000, 2304), (3000, 1024)):
        x, w, dy = torch_inputs(shape, torch.bfloat16, seed=6)
        xj, wj, dyj = (jnp.asarray(t.float().cpu().numpy()).astype(jnp.bfloat16) for t in (x, w, dy))
        dx_jax, dw_jax = jax.vjp(pn.rms_norm, xj, wj)[1](dyj)
        for _ in range(3):
            _, dx, dw = autograd_outputs(lambda a, b: torch_bridge.rms_norm(a, b, backend="pallas"), x, w, dy)
            np.testing.assert_array_equal(bits(dx), bits(dx_jax))
            np.testing.assert_array_equal(bits(dw), bits(dw_jax))
        cfg = dataclasses.replace(pallas_config.heuristic(*shape, backward=True), ffi_launch=False)
        dx_xla = jax.vjp(lambda a, b: pn.rms_norm(a, b, impl="pallas", bwd_config=cfg), xj, wj)[1](dyj)[0]
        diff = np.abs(np.asarray(dx_xla, np.float32) - np.asarray(dx_jax, np.float32))
        assert diff.max() <= 2.0 ** -7 * np.abs(np.asarray(dx_jax, np.float32)).max()


@gpu
@hopper
def test_gpu_torch_launch_route_gives_jax_bits_and_xla_s_launch_agrees():
    """``backend="pallas"`` on CUDA tensors launches the same PTX (assembled by the driver, not by jaxlib's ptxas):
    JAX's bits, call after call. The XLA-launched kernel of the same tile (XLA's Triton and assembler) agrees
    within a rounding of the output."""
    import torch_bridge

    for shape in ((512, 32768), (300, 16384), (257, 8192), (301, 3584), (4096, 1024)):
        x, w, _ = torch_inputs(shape, torch.bfloat16, seed=5)
        y_jax = pn.rms_norm(jnp.asarray(x.float().cpu().numpy()).astype(jnp.bfloat16),
                            jnp.asarray(w.float().cpu().numpy()).astype(jnp.bfloat16))
        runs = [torch_bridge.rms_norm(x, w, backend="pallas") for _ in range(3)]
        for y in runs:
            np.testing.assert_array_equal(bits(y), bits(y_jax))
        cfg = dataclasses.replace(pallas_config.heuristic(*shape, backward=False), ffi_launch=False)
        y_xla = pn.rms_norm(jnp.asarray(x.float().cpu().numpy()).astype(jnp.bfloat16),
                            jnp.asarray(w.float().cpu().numpy()).astype(jnp.bfloat16), impl="pallas", config=cfg)
        diff = np.abs(np.asarray(y_xla, np.float32) - np.asarray(y_jax, np.float32))
        assert diff.max() <= 2.0 ** -7 * np.abs(np.asarray(y_jax, np.float32)).max()


@gpu
@hopper
@pytest.mark.parametrize("n", [256, 1024, 2048, 3584, 4096, 8192, 16384, 32768])
def test_gpu_fused_add_y_is_rms_norm_of_h_bit_for_bit(n):
    """``rms_norm_add``'s y is ``rms_norm(h)``'s bits (8192 rows: a differing reduction order shows in a few rows
    only; 300 rows hid it at 1024 and 8192 columns), the jaxlib-launched widths included. Broken variants: the fused
    add on another warp count (the seventeenth session's 1 warp at 1024; 8 warps launched by XLA at 8192 and 32768,
    on an H200 16 launched by jaxlib at 8192, whose tile there has 8; at 16384 the 16 warps jaxlib launched before the
    thirty-first session: 8 launched by XLA give 32's bits on these rows; on an H200, whose tile there has 16, the
    32 jaxlib launches elsewhere; at 3584 and 4096 XLA's 2 rows on 16 warps on an H200, whose tiles there are
    jaxlib's on 8, and jaxlib's 2 rows on 8 elsewhere), whose bits differ. The one exception, an H200's 32768 (the
    plain forward in two passes, ``FWD_FFI_TWO_PASS_PLAIN_BY_MODEL``): y is ``rms_norm(h)``'s on the fused add's
    tile, and within two ulps of the default's (not equal: the check can fail)."""
    x, w, _ = jax_inputs((8192, n), jnp.bfloat16, seed=11)
    r = jax_inputs((8192, n), jnp.bfloat16, seed=12)[0]
    y, h = pn.rms_norm_add(x, r, w)
    plain, fused = (pallas_config.heuristic(8192, n, backward=False, fused=f) for f in (False, True))
    if not plain.resident(n):  # FWD_FFI_TWO_PASS_PLAIN_BY_MODEL (an H200, 32768; Llama's product rounds twice)
        _y_on_the_fused_tile_within_two_ulps_of_two_passes(y, h, w, fused)
        return
    np.testing.assert_array_equal(bits(y), bits(pn.rms_norm(h, w)))
    eight = pallas_config.heuristic(8192, 8192, backward=False).num_warps == 8  # the H200's tile (FWD_FFI_RESIDENT)
    other = 32 if pallas_config.heuristic(8192, 16384, backward=False).num_warps == 16 else 16  # the H200's: 16
    exact = pallas_config.heuristic(8192, 4096, backward=False).ffi_launch  # FWD_FFI_EXACT_BY_MODEL (H200)
    at_4096 = Config(2, 4096, 16) if exact else Config(2, 4096, 8, ffi_launch=True)
    broken = {1024: Config(2, 1024, 1), 3584: at_4096, 4096: at_4096,
              8192: Config(1, 8192, 16, ffi_launch=True) if eight else Config(1, 8192, 8),
              16384: Config(1, 16384, other, ffi_launch=True), 32768: Config(1, 32768, 8)}
    if n in broken:
        y_broken, h = pn.rms_norm_add(x, r, w, impl="pallas", config=broken[n])
        assert not np.array_equal(bits(y_broken), bits(pn.rms_norm(h, w)))


@gpu
@hopper
@pytest.mark.parametrize("n", [8192, 16384, 32768])
def test_gpu_gemma_fused_add_y_within_two_ulps_of_the_plain_two_passes(n):
    """Gemma's float32 product on an H200 (``FWD_FFI_TWO_PASS_PLAIN_BY_MODEL``): the plain forward of rows of 8192,
    16384 and 32768 runs two passes over column chunks, the fused add's a resident row. The fused add's y is then
    ``rms_norm(h)``'s bits on the fused add's tile, and within two ulps of the default's (not equal: the check can
    fail). Where the plain forward is resident (an H100) the bits are equal."""
    kw = dict(offset=1.0, casting="gemma")
    x, w, _ = jax_inputs((8192, n), jnp.bfloat16, 1.0, seed=13)
    r = jax_inputs((8192, n), jnp.bfloat16, 1.0, seed=14)[0]
    y, h = pn.rms_norm_add(x, r, w, **kw)
    plain, fused = (pallas_config.heuristic(8192, n, backward=False, fused=f, product_in_dtype=False)
                    for f in (False, True))
    if plain.resident(n):
        np.testing.assert_array_equal(bits(y), bits(pn.rms_norm(h, w, **kw)))
        return
    assert fused.resident(n)
    _y_on_the_fused_tile_within_two_ulps_of_two_passes(y, h, w, fused, **kw)


def _y_on_the_fused_tile_within_two_ulps_of_two_passes(y, h, w, fused: Config, **kw) -> None:
    """The fused add's ``y`` is ``rms_norm(h)``'s bits on the fused add's (resident) tile ``fused``, and within two
    ulps of the default's, whose plain forward runs two passes (``FWD_FFI_TWO_PASS_PLAIN_BY_MODEL``): not equal, so
    the check can fail."""
    np.testing.assert_array_equal(bits(y), bits(pn.rms_norm(h, w, impl="pallas", config=fused, **kw)))
    ulps = np.abs(bits(y).astype(np.int32) - bits(pn.rms_norm(h, w, **kw)).astype(np.int32))
    assert 0 < ulps.max() <= 2


@gpu
@hopper
@pytest.mark.parametrize("m,n,casting", [(4096, 1024, "llama"), (32768, 1024, "llama"), (8192, 2048, "llama"),
                                          (32768, 2304, "llama"), (32768, 2304, "gemma"), (4096, 5376, "llama"),
                                          (8192, 6144, "gemma"), (4096, 12288, "llama")])
def test_gpu_xla_tile_fused_add_keeps_rms_norm_s_rstd_bits(m, n, casting):
    """Where both forwards are launched by jaxlib on XLA's tiles (``FWD_FFI_FEW_ROWS`` at 4096×1024; on an H200
    ``FWD_FFI_ALL_ROWS`` at 1024-2048 columns, ``FWD_FFI_XLA_TILE_BY_MODEL`` at 2304-12288 per casting): the fused
    add's rstd (which its backward's dweight is built on) is ``rms_norm(h)``'s bits, and its y. Broken variant: the
    fused add's forward launched by XLA (XLA's Triton sums a thread's elements in another order), whose rstd bits
    differ."""
    from pallas_norm import api

    offset = 1.0 if casting == "gemma" else 0.0
    x, w, _ = jax_inputs((m, n), jnp.bfloat16, offset, seed=21)
    r = jax_inputs((m, n), jnp.bfloat16, seed=22)[0]
    low = kernels.product_in_dtype(w.dtype, x.dtype, casting, offset)
    plain, fused = (pallas_config.heuristic(m, n, backward=False, fused=f, product_in_dtype=low) for f in (False, True))
    if (m, n) != (4096, 1024) and not plain.ffi_launch:
        pytest.skip("XLA launches this forward on this GPU model (ffi_tables.FWD_FFI_ALL_ROWS, _XLA_TILE_BY_MODEL)")
    assert plain.ffi_launch and fused.ffi_launch
    y, h, rstd = api.forward_fn(1e-6, offset, casting, "auto", None, jnp.bfloat16)(x, r, w)
    y_h, rstd_h = api.forward_fn(1e-6, offset, casting, "auto")(h, w)
    np.testing.assert_array_equal(bits(rstd), bits(rstd_h))
    np.testing.assert_array_equal(bits(y), bits(y_h))
    xla = dataclasses.replace(fused, ffi_launch=False)
    rstd_xla = api.forward_fn(1e-6, offset, casting, "pallas", xla, jnp.bfloat16)(x, r, w)[2]
    assert not np.array_equal(bits(rstd_xla), bits(rstd_h))
