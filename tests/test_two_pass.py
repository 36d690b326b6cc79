"""The forward in two passes over column chunks with L1 hints (``Config.l1_hints``, ``pallas_config.FWD_FFI_TWO_PASS``,
jaxlib's launch): where the heuristic takes it, that the hints reach the kernel's loads and nowhere else, its results
under the interpreter and on a GPU (the accuracy rule, the bits without the hints, the fused add's y, the torch launch
route's bits); the Triton reference's two-pass forward likewise (``triton_two_pass``)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import pallas_norm as pn
from pallas_norm import backend, pallas_config, triton_ffi
from pallas_norm.pallas_config import Config

from helpers import bits, check_jax, h100_forward_ttir, hopper, jax_inputs, judge, torch_inputs


def test_heuristic_takes_the_two_pass_forward_at_the_table_s_widths_only(monkeypatch):
    """16-bit rows of 5120 columns, plain and fused add alike (one tile: the fused add's y is rms_norm(h)'s bits), one
    row per program; 16 warps where y's product is in the row dtype, 8 where it is float32 (2048-column chunks on 16
    from 96 rows per SM); not for 4-byte rows, other widths, the backward, nor without ``available()`` (the resident
    tile, XLA's launch)."""
    monkeypatch.setattr(backend, "num_sms", lambda: 132)
    monkeypatch.setattr(triton_ffi, "available", lambda: False)
    resident = pallas_config.heuristic(4096, 5120, backward=False)
    assert resident == Config(1, 8192, 8, l1_hints=True)  # padded to 8192: the resident hints (l1_hints.resident)
    monkeypatch.setattr(triton_ffi, "available", lambda: True)
    for fused in (False, True):
        for low, warps in ((True, 16), (False, 8)):
            config = pallas_config.heuristic(4096, 5120, backward=False, fused=fused, product_in_dtype=low)
            assert config == Config(1, 4096, warps, programs=4096, ffi_launch=True, l1_hints=True)
        many = 96 * 132
        for m, low, tile in ((many, False, (2048, 16)), (many - 1, False, (4096, 8)), (65536, True, (4096, 16))):
            config = pallas_config.heuristic(m, 5120, backward=False, fused=fused, product_in_dtype=low)
            assert config == Config(1, *tile, programs=m, ffi_launch=True, l1_hints=True)
    assert pallas_config.heuristic(3, 5120, backward=False).programs == 3
    assert pallas_config.heuristic(4096, 5120, backward=False, itemsize=4) == resident
    for n in (5000, 4096, 2304, 3584):
        assert pallas_config.heuristic(4096, n, backward=False).resident(n)  # resident (with the resident hints)
    assert not pallas_config.heuristic(4096, 5120, backward=True).l1_hints


def test_l1_hints_are_an_option_of_the_forward_without_bands():
    """Refused for the backward and for column bands; a resident row takes them (every load ``evict_last``)."""
    for bad, n, backward in ((Config(1, 1024, 4, programs=8, l1_hints=True), 4096, True),
                             (Config(1, 1024, 1, lag=2, l1_hints=True), 4096, False)):
        with pytest.raises(ValueError, match="l1_hints"):
            pallas_config.fit(bad, 8, n, backward=backward)
    assert pallas_config.fit(Config(1, 8192, 8, l1_hints=True), 8, 5120, backward=False).l1_hints
    with pytest.raises(ValueError, match="l1_hints"):
        Config(1, 1024, 4, l1_hints=1)


@pytest.mark.parametrize("fused", [False, True])
def test_both_stacks_take_the_resident_hints_by_one_rule(fused, monkeypatch):
    """The resident forward (plain and fused add) takes ``l1_hints`` where ``l1_hints.resident`` says, in both stacks:
    rows padded to 1024 columns or more; not the per-head widths, nor the bands."""
    from pallas_norm import l1_hints
    from torch_bridge import triton_config

    monkeypatch.setattr(backend, "num_sms", lambda: 132)
    widths = (128, 512, 1000, 1024, 2304, 4096, 8192, 16384, 32768)
    want = {n: n >= 1000 for n in widths}
    assert {n: l1_hints.resident(pallas_config.next_pow2(n)) for n in widths} == want
    pallas = {n: pallas_config.heuristic(4096, n, backward=False, fused=fused) for n in widths}
    assert {n: c.l1_hints for n, c in pallas.items() if c.resident(n)} == {n: want[n] for n in widths if n <= 16384}
    triton = {n: triton_config.forward_config(n, 132, 2, True) for n in widths}
    assert {n: c.l1_hints for n, c in triton.items()} == want
    assert not pallas_config.heuristic(4096, 65536, backward=False, fused=fused).l1_hints  # bands
    assert not triton_config.forward_config(65536, 132, 2, True).l1_hints


def _hinted(ttir: str) -> dict:
    """How many of the Triton IR's loads carry each L1 hint, and how many loads there are."""
    loads = [line for line in ttir.splitlines() if "tt.load" in line]
    return {h: sum(h in line for line in loads) for h in ("evict_last", "evict_first")} | {"loads": len(loads)}


def test_the_hints_reach_the_loads_of_the_two_passes(monkeypatch):
    """The first pass's loads of x carry ``evict_last``, the second's ``evict_first``; the weight's carry none. Broken
    variant: the same tile without ``l1_hints``, whose loads carry no hint."""
    hinted = _hinted
    tile = Config(1, 4096, 16, programs=8)
    with_hints = hinted(h100_forward_ttir(monkeypatch, 8, 5120, dataclasses.replace(tile, l1_hints=True)))
    without = hinted(h100_forward_ttir(monkeypatch, 8, 5120, tile))
    assert with_hints["evict_last"] == with_hints["evict_first"] >= 1
    assert with_hints["evict_last"] + with_hints["evict_first"] < with_hints["loads"]  # the weight's: none
    assert without["evict_last"] == without["evict_first"] == 0 and without["loads"] == with_hints["loads"]


def test_a_resident_row_s_loads_all_carry_evict_last(monkeypatch):
    """With ``l1_hints`` the resident forward loads x and the weight ``evict_last``, nothing ``evict_first``. Broken
    variant: the same tile without, whose loads carry no hint."""
    tile = Config(1, 8192, 16)
    with_hints = _hinted(h100_forward_ttir(monkeypatch, 8, 8192, dataclasses.replace(tile, l1_hints=True)))
    without = _hinted(h100_forward_ttir(monkeypatch, 8, 8192, tile))
    assert with_hints["evict_last"] == 2 and with_hints["evict_first"] == 0  # x and the weight (the rest: stores')
    assert without == {"evict_last": 0, "evict_first": 0, "loads": with_hints["loads"]}


@pytest.mark.parametrize("dtype,casting,offset,warps", [(jnp.bfloat16, "llama", 0.0, 16),
                                                         (jnp.float16, "gemma", 1.0, 8)], ids=str)
def test_interpreted_two_pass_meets_the_rule_and_the_fused_add_s_y_is_rms_norm_of_h(dtype, casting, offset, warps):
    """The table's tile under the interpreter (ragged 5000 columns: the second chunk part-masked), held to the accuracy
    rule (with the backward); the fused add's y on the same tile is ``rms_norm(h)``'s bits."""
    config = Config(1, 4096, warps, programs=7, l1_hints=True)
    x, w, dy = jax_inputs((7, 5000), dtype, offset, seed=4)
    mode = dict(eps=1e-6, offset=offset, casting=casting)
    check_jax(x, w, dy, impl="interpret", config=config, **mode)
    r = jax_inputs((7, 5000), dtype, offset, seed=5)[0]
    y_add, h = pn.rms_norm_add(x, r, w, impl="interpret", config=config, **mode)
    np.testing.assert_array_equal(bits(y_add), bits(pn.rms_norm(h, w, impl="interpret", config=config, **mode)))


gpu = pytest.mark.gpu


@gpu
@hopper
@pytest.mark.parametrize("shape,dtype,casting,offset", [((3000, 5120), jnp.bfloat16, "llama", 0.0),
                                                        ((1001, 5120), jnp.float16, "gemma", 1.0),
                                                        ((257, 5120), jnp.bfloat16, "none", 0.0)], ids=str)
def test_gpu_two_pass_forward_runs_through_jaxlib_meets_the_rule_and_hints_keep_the_bits(shape, dtype, casting,
                                                                                          offset):
    """``impl=None``'s forward holds the jaxlib call and meets the accuracy rule (the backward too); the same tile
    without the hints gives the same bits (a hint moves no value)."""
    x, w, dy = jax_inputs(shape, dtype, offset, seed=7)
    mode = dict(eps=1e-6, offset=offset, casting=casting)
    assert triton_ffi.FFI_TARGET in jax.jit(lambda a, b: pn.rms_norm(a, b, **mode)).lower(x, w).as_text()
    check_jax(x, w, dy, impl=None, **mode)
    config = pallas_config.heuristic(*shape, backward=False, product_in_dtype=casting != "gemma")
    assert config.l1_hints
    y = pn.rms_norm(x, w, impl="pallas", config=config, **mode)
    np.testing.assert_array_equal(bits(y), bits(pn.rms_norm(x, w, **mode)))
    plain = pn.rms_norm(x, w, impl="pallas", config=dataclasses.replace(config, l1_hints=False), **mode)
    np.testing.assert_array_equal(bits(plain), bits(y))


@gpu
@hopper
@pytest.mark.parametrize("rows,casting,offset", [(8192, "llama", 0.0), (8192, "gemma", 1.0), (16384, "gemma", 1.0)])
def test_gpu_two_pass_fused_add_y_is_rms_norm_of_h_bit_for_bit(rows, casting, offset):
    """8192 rows of 5120 columns (a differing reduction order shows in a few rows only), and gemma's tile for many
    rows (on an H200 the resident tile for Llama's product and Gemma's many rows: ``FWD_FFI_TWO_PASS_BY_MODEL``).
    Broken variant: the fused add on the other kind of tile (the resident one the forward took before, or on an
    H200 the H100's two passes), whose y differs from ``rms_norm(h)``'s."""
    x, w, _ = jax_inputs((rows, 5120), jnp.bfloat16, offset, seed=11)
    r = jax_inputs((rows, 5120), jnp.bfloat16, offset, seed=12)[0]
    mode = dict(offset=offset, casting=casting)
    y, h = pn.rms_norm_add(x, r, w, **mode)
    np.testing.assert_array_equal(bits(y), bits(pn.rms_norm(h, w, **mode)))
    tile = pallas_config.heuristic(rows, 5120, backward=False, fused=True, product_in_dtype=casting != "gemma")
    broken = Config(1, 4096, 16, programs=rows, ffi_launch=True, l1_hints=True) if tile.resident(5120) else Config(
        1, 8192, 8)
    y_broken, h = pn.rms_norm_add(x, r, w, impl="pallas", config=broken, **mode)
    assert not np.array_equal(bits(y_broken), bits(pn.rms_norm(h, w, **mode)))


@gpu
@hopper
def test_gpu_torch_launch_route_gives_the_two_pass_bits():
    """``backend="pallas"`` on CUDA tensors launches the two-pass kernel's PTX: JAX's y, dx and dweight bits."""
    import torch_bridge
    from torch_bridge.numpy_io import autograd_outputs

    x, w, dy = torch_inputs((999, 5120), torch.bfloat16, seed=6)
    xj, wj, dyj = (jnp.asarray(t.float().cpu().numpy()).astype(jnp.bfloat16) for t in (x, w, dy))
    y_jax, vjp = jax.vjp(pn.rms_norm, xj, wj)
    for ours, theirs in zip(autograd_outputs(lambda a, b: torch_bridge.rms_norm(a, b, backend="pallas"), x, w, dy),
                            (y_jax, *vjp(dyj))):
        np.testing.assert_array_equal(bits(ours), bits(theirs))


# ----------------------------------------------------------------------------------------------
# The Triton reference's two-pass forward (triton_two_pass: the same table and design, N a compile-time constant)
# ----------------------------------------------------------------------------------------------
def _triton():
    from torch_bridge import triton_config, triton_kernels

    return triton_config, triton_kernels


def test_triton_reference_takes_the_same_table():
    """``triton_config.forward_config`` reads ``FWD_FFI_TWO_PASS``: 16-bit rows of 5120 columns, 16 warps where y's
    product is in the row dtype, 8 where it is float32 (2048-column chunks on 16 from 96 rows per SM, as the Pallas
    kernels' for the same rows); the resident tile for 4-byte rows and other widths."""
    triton_config, _ = _triton()
    for low, warps in ((True, 16), (False, 8)):
        assert triton_config.forward_config(5120, 132, 2, low) == triton_config.Config(1, 4096, warps, l1_hints=True)
    for m, sms, low in ((96 * 132, 132, False), (96 * 100, 100, False), (96 * 132 - 1, 132, False), (65536, 132, True)):
        tile = pallas_config.two_pass_tile(5120, 2, low, m, sms)
        assert tile == ((2048, 16) if not low and m >= 96 * sms else (4096, 16 if low else 8))
        assert triton_config.forward_config(5120, sms, 2, low, m) == triton_config.Config(1, *tile, l1_hints=True)
    assert triton_config.forward_config(5120, 132, 4) == triton_config.Config(1, 8192, 8, l1_hints=True)
    for n in (5000, 4096, 2304, 8192):
        assert not triton_config.forward_config(n, 132, 2).chunked(n)


def test_triton_l1_hints_are_an_option_of_the_forward_without_bands():
    """Refused with bands or pieces (by ``Config``), in column chunks of more than one row per program or a chunk as
    long as the row (by the two-pass launcher), and for the backward."""
    from torch_bridge import triton_two_pass

    triton_config, triton_kernels = _triton()
    for bad in (dict(lag=2), dict(pieces=True)):
        with pytest.raises(ValueError, match="l1_hints"):
            triton_config.Config(**{"block_m": 1, "block_n": 1024, "num_warps": 4, "l1_hints": True, **bad})
    x, w, dy = torch_inputs((3, 1000), torch.bfloat16, seed=1)
    with pytest.raises(ValueError, match="l1_hints"):
        triton_kernels.rms_norm_fwd(x, w, 1e-6, 0.0, "llama", triton_config.Config(2, 256, 4, l1_hints=True))
    with pytest.raises(ValueError, match="l1_hints"):
        triton_two_pass.check(triton_config.Config(1, 1024, 4, l1_hints=True), 1000)
    y, rstd = triton_kernels.rms_norm_fwd(x, w, 1e-6, 0.0, "llama", triton_config.Config(2, 1024, 4, l1_hints=True))
    plain = triton_kernels.rms_norm_fwd(x, w, 1e-6, 0.0, "llama", triton_config.Config(2, 1024, 4))[0]
    np.testing.assert_array_equal(bits(y), bits(plain))
    with pytest.raises(ValueError, match="l1_hints"):
        triton_kernels.rms_norm_bwd(dy, x, w, rstd, 0.0, "llama", True, True,
                                    triton_config.Config(1, 512, 4, l1_hints=True))


@pytest.mark.parametrize("dtype,casting,offset,n,warps", [(torch.bfloat16, "llama", 0.0, 5000, 16),
                                                           (torch.float16, "gemma", 1.0, 5120, 8),
                                                           (torch.float32, "none", 0.0, 3000, 4)], ids=str)
def test_triton_two_pass_meets_the_rule_with_the_chunked_walk_s_bits(dtype, casting, offset, n, warps):
    """The two-pass kernel (a full chunk and a part-masked one; 3000 columns in chunks of 1024: three) held to the
    accuracy rule with the backward; its y and rstd are the run-time chunked walk's bits (the same sum order, no
    hints) and the fused add's y on it is ``rms_norm(h)``'s."""
    triton_config, triton_kernels = _triton()
    config = triton_config.Config(1, 4096 if n > 4096 else 1024, warps, l1_hints=True)
    x, w, dy = torch_inputs((7, n), dtype, offset, seed=3)
    mode = dict(offset=offset, casting=casting)
    y, rstd = triton_kernels.rms_norm_fwd(x, w, 1e-6, config=config, **mode)
    dx, dw = triton_kernels.rms_norm_bwd(dy, x, w, rstd, offset, casting, True, True)
    assert judge(x, w, dy, (y, dx, dw), eps=1e-6, **mode) == []
    walk = triton_kernels.rms_norm_fwd(x, w, 1e-6, config=dataclasses.replace(config, l1_hints=False), **mode)
    for a, b in zip((y, rstd), walk):
        np.testing.assert_array_equal(bits(a), bits(b))
    r = torch_inputs((7, n), dtype, seed=4)[0]
    y_add, h, _ = triton_kernels.rms_norm_fwd(x, w, 1e-6, config=config, residual=r, h_dtype=dtype, **mode)
    np.testing.assert_array_equal(bits(y_add), bits(triton_kernels.rms_norm_fwd(h, w, 1e-6, config=config, **mode)[0]))


def _ptx(monkeypatch, call) -> str:
    """The PTX of the forward kernel ``call()`` launches (launched once more through Triton's own path)."""
    from torch_bridge import triton_launch

    seen = []
    real = triton_launch.launch
    monkeypatch.setattr(triton_launch, "launch",
                        lambda key, kernel, grid, args, meta, **k: (seen.append((kernel, grid, args, meta())),
                                                                    real(key, kernel, grid, args, meta, **k)))
    call()
    kernel, grid, args, meta = seen[-1]
    return kernel[grid](*args, **meta).asm["ptx"]


@gpu
@hopper
@pytest.mark.parametrize("shape,dtype,casting,offset", [((3000, 5120), torch.bfloat16, "llama", 0.0),
                                                        ((1001, 5120), torch.float16, "gemma", 1.0)], ids=str)
def test_gpu_triton_two_pass_meets_the_rule_and_its_loads_carry_the_hints(shape, dtype, casting, offset,
                                                                           monkeypatch):
    """``backend="triton"`` at 5120 columns (the two-pass kernel, on an H200 the resident one for Llama's product)
    meets the accuracy rule (with the backward); the two-pass kernel (the H100's tile) gives the run-time walk's
    bits, and its PTX loads with L1's ``evict_last`` and ``evict_first``. Broken variant: the run-time walk's PTX
    carries neither."""
    from helpers import check_case

    triton_config, triton_kernels = _triton()
    check_case(shape, dtype, casting, offset)
    x, w, _ = torch_inputs(shape, dtype, offset, seed=8)
    config = triton_config.forward_config(shape[1], 132, 2, casting != "gemma")
    assert config.chunked(shape[1])
    mode = dict(offset=offset, casting=casting)
    y, rstd = triton_kernels.rms_norm_fwd(x, w, 1e-6, config=config, **mode)
    walk = triton_kernels.rms_norm_fwd(x, w, 1e-6, config=dataclasses.replace(config, l1_hints=False), **mode)
    for a, b in zip((y, rstd), walk):
        np.testing.assert_array_equal(bits(a), bits(b))
    hinted = _ptx(monkeypatch, lambda: triton_kernels.rms_norm_fwd(x, w, 1e-6, config=config, **mode))
    assert "L1::evict_last" in hinted and "L1::evict_first" in hinted
    plain = _ptx(monkeypatch, lambda: triton_kernels.rms_norm_fwd(
        x, w, 1e-6, config=dataclasses.replace(config, l1_hints=False), **mode))
    assert "L1::evict_last" not in plain and "L1::evict_first" not in plain


@gpu
@hopper
@pytest.mark.parametrize("rows,casting,offset", [(8192, "llama", 0.0), (8192, "gemma", 1.0), (16384, "gemma", 1.0)])
def test_gpu_triton_two_pass_fused_add_y_is_rms_norm_of_h_bit_for_bit(rows, casting, offset):
    """8192 rows of 5120 columns through ``backend="triton"``'s heuristic, and gemma's tile for many rows (on an
    H200 resident for Llama's product and Gemma's many rows). Broken variant: the fused add on the other kind of
    tile (the resident one the reference took before; on an H200 the H100's two passes), whose y differs from
    ``rms_norm(h)``'s."""
    from torch_bridge import triton_launch

    triton_config, triton_kernels = _triton()
    x, w, _ = torch_inputs((rows, 5120), torch.bfloat16, offset, seed=11)
    r = torch_inputs((rows, 5120), torch.bfloat16, seed=12)[0]
    mode = dict(offset=offset, casting=casting)
    y, h, _ = triton_kernels.rms_norm_fwd(x, w, 1e-6, residual=r, h_dtype=x.dtype, **mode)
    np.testing.assert_array_equal(bits(y), bits(triton_kernels.rms_norm_fwd(h, w, 1e-6, **mode)[0]))
    tile = triton_config.forward_config(5120, 132, 2, casting != "gemma", rows, True, triton_launch.gpu_model(x))
    broken = triton_config.Config(1, 4096, 16, l1_hints=True) if not tile.chunked(5120) else triton_config.Config(
        1, 8192, 8)
    y_broken, h, _ = triton_kernels.rms_norm_fwd(x, w, 1e-6, config=broken, residual=r, h_dtype=x.dtype, **mode)
    assert not np.array_equal(bits(y_broken), bits(triton_kernels.rms_norm_fwd(h, w, 1e-6, **mode)[0]))


@gpu
@hopper
@pytest.mark.parametrize("n,fused,casting,offset", [(16384, False, "llama", 0.0), (2304, True, "gemma", 1.0),
                                                    (1024, False, "llama", 0.0)])
def test_gpu_resident_hints_keep_the_bits_in_both_stacks(n, fused, casting, offset, monkeypatch):
    """The heuristic's resident tile takes the hints (``l1_hints.resident``) in both stacks; y (and the fused add's h)
    are the same bits without them, in JAX and in the Triton reference, whose PTX then loads ``L1::evict_last``.
    Broken variant: the tile without the hints, whose PTX carries none."""
    from torch_bridge import triton_launch

    triton_config, triton_kernels = _triton()
    mode = dict(offset=offset, casting=casting)
    x, w, _ = jax_inputs((1001, n), jnp.bfloat16, offset, seed=21)
    r = jax_inputs((1001, n), jnp.bfloat16, seed=22)[0]
    config = pallas_config.heuristic(1001, n, backward=False, fused=fused, product_in_dtype=casting != "gemma")
    assert config.l1_hints

    def pallas(c):
        return pn.rms_norm_add(x, r, w, config=c, **mode) if fused else (pn.rms_norm(x, w, config=c, **mode),)

    for a, b in zip(pallas(config), pallas(dataclasses.replace(config, l1_hints=False))):
        np.testing.assert_array_equal(bits(a), bits(b))
    xt, wt, _ = torch_inputs((1001, n), torch.bfloat16, offset, seed=21)
    rt = torch_inputs((1001, n), torch.bfloat16, seed=22)[0]
    tconfig = triton_config.forward_config(n, triton_launch.sm_count(xt), 2, casting != "gemma")
    assert tconfig.l1_hints

    def triton(c):
        extra = dict(residual=rt, h_dtype=xt.dtype) if fused else {}
        return triton_kernels.rms_norm_fwd(xt, wt, 1e-6, config=c, **mode, **extra)

    for a, b in zip(triton(tconfig), triton(dataclasses.replace(tconfig, l1_hints=False))):
        np.testing.assert_array_equal(bits(a), bits(b))
    assert "L1::evict_last" in _ptx(monkeypatch, lambda: triton(tconfig))
    assert "L1::evict_last" not in _ptx(monkeypatch, lambda: triton(dataclasses.replace(tconfig, l1_hints=False)))
