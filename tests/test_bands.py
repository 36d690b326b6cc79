"""Long rows on column bands (``Config.lag``, ``pallas_norm/bands.py``), forward and backward: row sums exchanged
through global memory, x (and dy) read once. On CPU the interpreter runs the programs one after another, so every
program but the last of a row group recomputes its peers' partial sums (the fallback) and the last reads them as
posted: both paths run."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import pallas_norm as pn
from pallas_norm import band_slots, bands, kernels, pallas_config
from pallas_norm.pallas_config import Config

from helpers import KERNEL, bits, check_jax, jax_inputs, jax_vjp

# (shape, config): ragged rows and blocks, 8 / 16 bands, lags 1-3, with and without prefetch, tiles read again or
# carried to their finish
CASES = [((37, 4000), Config(4, 512, 4, lag=2)), ((5, 2048), Config(2, 128, 4, lag=3, prefetch=True)),
         ((64, 1536), Config(8, 256, 2, lag=1, prefetch=True)),
         ((37, 4000), Config(4, 512, 4, lag=2, prefetch=True, programs=24)),  # 8 bands in 3 row groups
         ((37, 4000), Config(4, 512, 4, lag=2, carry=True)),
         ((37, 4000), Config(2, 512, 4, lag=3, prefetch=True, programs=24, carry=True))]


@pytest.mark.parametrize("dtype,casting,offset", [(jnp.bfloat16, "llama", 0.0), (jnp.float16, "gemma", 1.0),
                                                  (jnp.float32, "none", 0.0)])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_bands_match_float64_rule(case, dtype, casting, offset):
    """Forward and backward on bands (y, rstd's use in dx, dweight)."""
    shape, config = CASES[case]
    x, w, dy = jax_inputs(shape, dtype, offset, seed=case, scale=2.0)
    check_jax(x, w, dy, "interpret", eps=1e-6, offset=offset, casting=casting, config=config, bwd_config=config)


def test_forward_rstd_and_fused_add_on_bands():
    """The band forward's rstd (stored by band 0's program) is the row's, h of the fused add is the resident
    path's bits, and y of the fused add is the norm of h."""
    config = CASES[0][1]
    x, w, _ = jax_inputs((37, 4000), jnp.bfloat16, 0.0, seed=11, scale=2.0)
    res = jax_inputs((37, 4000), jnp.bfloat16, 0.0, seed=12)[0]
    _, rstd = pn.rms_norm_with_rstd(x, w, impl="interpret", config=config)
    x64 = np.asarray(x, np.float64)
    np.testing.assert_allclose(np.asarray(rstd), 1 / np.sqrt(np.mean(x64 * x64, axis=1) + 1e-6), rtol=2e-6)
    y, h = pn.rms_norm_add(x, res, w, impl="interpret", config=config)
    y_ref, h_ref = pn.rms_norm_add(x, res, w, impl="interpret")
    np.testing.assert_array_equal(bits(h), bits(h_ref))
    np.testing.assert_array_equal(bits(y), bits(pn.rms_norm(h, w, impl="interpret", config=config)))
    assert float(jnp.max(jnp.abs(y.astype(jnp.float32) - y_ref.astype(jnp.float32)))) <= 2 ** -7 * 8


def test_float32_weight_with_bfloat16_rows():
    """dweight is stored in the weight's dtype by each band's owner."""
    x, w, dy = jax_inputs((37, 4000), jnp.bfloat16, 1.0, weight_dtype=jnp.float32, seed=9, scale=2.0)
    check_jax(x, w, dy, "interpret", eps=1e-6, offset=1.0, casting="gemma", bwd_config=CASES[0][1])


def test_too_few_slots_is_caught(monkeypatch):
    """The rule above catches a broken exchange: slots for half the bands (the other half's partial sums are
    written past a row's slots, into the next row's, and every total is wrong)."""
    monkeypatch.setattr(band_slots, "slot_cols", lambda config, n: config.chunks(n) // 2)
    x, w, dy = jax_inputs((37, 4000), jnp.bfloat16, 0.0, seed=7, scale=2.0)
    with pytest.raises(AssertionError, match="dx"):
        check_jax(x, w, dy, "interpret", eps=1e-6, bwd_config=Config(4, 512, 2, lag=2))  # a config traced only here


def test_row_groups_give_one_groups_bits():
    """Row groups change who walks which rows, not the row sums: y, rstd and dx are one group's bits; dweight is the
    groups' partials summed in group order (float64 rule above)."""
    x, w, dy = jax_inputs((37, 4000), jnp.bfloat16, 0.0, seed=13, scale=2.0)
    one, grouped = Config(2, 512, 4, lag=2, prefetch=True), Config(2, 512, 4, lag=2, prefetch=True, programs=32)
    assert band_slots.groups(pallas_config.fit(grouped, 37, 4000, backward=True), 4000) == 4
    (y1, r1), (y4, r4) = (pn.rms_norm_with_rstd(x, w, impl="interpret", config=c) for c in (one, grouped))
    np.testing.assert_array_equal(bits(y4), bits(y1))
    np.testing.assert_array_equal(bits(r4), bits(r1))
    np.testing.assert_array_equal(bits(_backward(x, w, dy, grouped)[0]), bits(_backward(x, w, dy, one)[0]))


def test_carried_tiles_give_the_read_again_bits():
    """Carrying a block's tiles to its finish changes where they come from, not the values: y, rstd, h of the fused
    add, dx and dweight are the bits of the kernels that read the band again."""
    x, w, dy = jax_inputs((37, 4000), jnp.bfloat16, 0.0, seed=14, scale=2.0)
    res = jax_inputs((37, 4000), jnp.bfloat16, 0.0, seed=15)[0]
    again, carried = Config(2, 512, 4, lag=2, prefetch=True), Config(2, 512, 4, lag=2, prefetch=True, carry=True)
    outs = [(*pn.rms_norm_with_rstd(x, w, impl="interpret", config=c), *pn.rms_norm_add(x, res, w, impl="interpret",
                                                                                      config=c),
             *_backward(x, w, dy, c)) for c in (again, carried)]
    for a, b in zip(*outs, strict=True):
        np.testing.assert_array_equal(bits(b), bits(a))


def test_carried_tiles_out_of_order_are_caught(monkeypatch):
    """The rule catches a carry that finishes the wrong block's tiles (the newest instead of the oldest: block
    t - 1's values written into block t - lag's rows)."""
    monkeypatch.setattr(bands, "_enqueue", lambda queue, tiles: (*queue[1:], tiles))
    x, w, dy = jax_inputs((37, 4000), jnp.bfloat16, 0.0, seed=16, scale=2.0)
    with pytest.raises(AssertionError, match="y"):  # a config traced only here
        check_jax(x, w, dy, "interpret", eps=1e-6, config=Config(4, 512, 2, lag=3, carry=True))


def test_forward_without_its_peers_sums_is_caught(monkeypatch):
    """The rule catches a forward whose exchange is broken: slots filled with a posted-looking 0.0 (each program
    sees its peers' partial sums as posted zeros before they are written, so rstd comes from too few columns)."""
    monkeypatch.setattr(band_slots, "slots",
                        lambda m, n, config: jnp.zeros((m, band_slots.slot_cols(config, n)), jnp.int32))
    x, w, dy = jax_inputs((37, 4000), jnp.bfloat16, 0.0, seed=8, scale=2.0)
    with pytest.raises(AssertionError, match="y"):
        check_jax(x, w, dy, "interpret", eps=1e-6, config=Config(4, 512, 2, lag=1))  # a config traced only here


def _backward(x, w, dy, config, impl="interpret", **kw):
    """``bands.backward`` on the forward's rstd (the API's forward, with its heuristic): ``(dx, dweight)``."""
    _, rstd = pn.rms_norm_with_rstd(x, w, eps=1e-6, impl=impl)
    return bands.backward(x, w, dy, rstd, offset=0.0, casting="llama", interpret=impl == "interpret",
                          config=pallas_config.fit(config, *x.shape, backward=True), **kw)


def test_g_in_the_row_dtype_keeps_the_float32_products_bits(monkeypatch):
    """The band backward's g = r(dy·w_eff) taken as one multiply in the row dtype (``tiles.grad_in_dtype``: bf16
    rows, Llama's casting, the weight in bf16) gives the float32 product's bits: dx and dweight, plain and fused add,
    equal with the choice turned off. Broken variant: the choice forced for Gemma's casting, whose w_eff = 1 + w is no
    bf16 value (rounded to one, g moves): its dx differs from the float32 product's."""
    x, w, dy = jax_inputs((37, 4000), jnp.bfloat16, 0.0, seed=21, scale=2.0)
    dh = jax_inputs((37, 4000), jnp.bfloat16, 0.0, seed=22)[0]
    config = pallas_config.fit(Config(2, 512, 4, lag=2, prefetch=True), 37, 4000, backward=True)

    def run(low, casting="llama", offset=0.0):
        monkeypatch.setattr(bands, "grad_in_dtype", lambda *args, **kw: low)
        _, rstd = pn.rms_norm_with_rstd(x, w, eps=1e-6, offset=offset, casting=casting, impl="interpret")
        kw = dict(offset=offset, casting=casting, config=config, interpret=True)
        return (*bands.backward(x, w, dy, rstd, **kw), *bands.backward(x, w, dy, rstd, dh_out=dh, **kw))

    for a, b in zip(run(True), run(False), strict=True):
        np.testing.assert_array_equal(bits(a), bits(b))
    forced, f32 = run(True, "gemma", 1.0)[0], run(False, "gemma", 1.0)[0]
    assert not np.array_equal(bits(forced), bits(f32))


def test_full_blocks_walk_gives_the_masked_walks_bits(monkeypatch):
    """Where every row block of every group and every band is full (``bands._full_walk``) the band kernels walk in
    three loops with constant row masks (``_walk_full_blocks``: unmasked loads and stores on a GPU). y, rstd, dx and
    dweight, plain and fused add, one row group and four, are the one masked loop's bits. Broken variant: the walk
    one block short, caught (the last block's rows). The fused add's backward of more than
    ``FULL_WALK_ADD_BWD_MAX_BANDS`` bands keeps the masked walk (slower there on an H200)."""
    x, w, dy = jax_inputs((32, 4096), jnp.bfloat16, 0.0, seed=31, scale=2.0)
    r = jax_inputs((32, 4096), jnp.bfloat16, 0.0, seed=32)[0]
    configs = [pallas_config.fit(c, 32, 4096, backward=True) for c in
               (Config(2, 512, 4, lag=2, prefetch=True), Config(2, 512, 4, lag=1, prefetch=True, programs=32))]
    assert [band_slots.groups(c, 4096) for c in configs] == [1, 4]
    assert all(bands._full_walk(32, 4096, c, add_backward=True) for c in configs)
    wide = pallas_config.fit(Config(1, 1024, 1, lag=2, prefetch=True, programs=1024), 1024, 262144, backward=True)
    assert bands._full_walk(1024, 262144, wide) and not bands._full_walk(1024, 262144, wide, add_backward=True)

    def run():
        outs = []
        for config in configs:
            kw = dict(offset=0.0, casting="llama", config=config, interpret=True)
            y, rstd = bands.forward(x, w, eps=1e-6, **kw)
            y_add, h, rstd_h = bands.forward(x, w, eps=1e-6, residual=r, h_dtype=x.dtype, **kw)
            outs += [y, rstd, y_add, h, rstd_h, *bands.backward(x, w, dy, rstd, **kw),
                     *bands.backward(h, w, dy, rstd_h, dh_out=r, **kw)]
        return outs

    full = run()
    with monkeypatch.context() as patched:
        patched.setattr(bands, "_full_walk", lambda *args, **kw: False)
        masked = run()
    for a, b in zip(full, masked, strict=True):
        np.testing.assert_array_equal(bits(a), bits(b))
    walk = bands._walk_full_blocks
    monkeypatch.setattr(bands, "_walk_full_blocks", lambda steps, lag, *args: walk(steps - 1, lag, *args))
    short = run()
    assert not all(np.array_equal(bits(a), bits(b)) for a, b in zip(short, masked))


def test_posted_and_recomputed_sums_have_the_same_bits():
    """Band 0's program (first in the interpreter) recomputes every peer's partial sum; the last band's reads them
    as posted. With the last band a copy of band 0 (x, dy, weight), their dx must be the same bits."""
    config = Config(4, 512, 4, lag=2)
    x, w, dy = jax_inputs((37, 4096), jnp.bfloat16, 0.0, seed=3, scale=2.0)
    x, dy = (a.at[:, -512:].set(a[:, :512]) for a in (x, dy))
    w = w.at[-512:].set(w[:512])
    dx, _ = _backward(x, w, dy, config)
    np.testing.assert_array_equal(bits(dx[:, :512]), bits(dx[:, -512:]))


def test_chunked_kernels_refuse_a_band_config():
    """``kernels.forward``/``backward`` would silently run a band config's tiling on the chunked path (the bench's
    first carveout run did): they refuse it."""
    x, w, dy = jax_inputs((8, 4096), jnp.bfloat16, 0.0, seed=1)
    config = pallas_config.fit(Config(4, 512, 4, lag=2), 8, 4096, backward=True)
    with pytest.raises(ValueError, match="lag=2"):
        kernels.forward(x, w, eps=1e-6, offset=0.0, casting="llama", config=config, interpret=True)
    with pytest.raises(ValueError, match="lag=2"):
        kernels.backward(x, w, dy, jnp.ones((8,), jnp.float32), offset=0.0, casting="llama", config=config,
                         interpret=True)


def test_dweight_alone_and_dx_alone_match_the_full_backward():
    """Without dx nothing is exchanged (no slots); without dweight none is stored: the same bits either way."""
    config = Config(4, 512, 4, lag=2)
    x, w, dy = jax_inputs((37, 4000), jnp.bfloat16, 1.0, seed=5, scale=2.0)
    dx, dw = _backward(x, w, dy, config)
    only_dw = _backward(x, w, dy, config, need_dx=False)
    only_dx = _backward(x, w, dy, config, need_dw=False)
    assert only_dw[0] is None and only_dx[1] is None
    np.testing.assert_array_equal(bits(only_dw[1]), bits(dw))
    np.testing.assert_array_equal(bits(only_dx[0]), bits(dx))


# ---------------------------------------------------------------- GPU
gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("shape,dtype", [((256, 262144), jnp.bfloat16), ((64, 262144), jnp.float32),
                                         ((300, 300000), jnp.float16), ((256, 16000), jnp.bfloat16),
                                         ((100, 20000), jnp.float16), ((128, 65536), jnp.float32),
                                         ((300, 10000), jnp.bfloat16)])
def test_gpu_bands_match_float64_rule(shape, dtype):
    """The heuristics' band configs (``impl="pallas"`` runs the backward on bands beyond 8192 columns, the forward
    beyond the 16384 it holds)."""
    assert pallas_config.heuristic(*shape, backward=True).lag
    assert bool(pallas_config.heuristic(*shape, backward=False).lag) == (shape[1] > pallas_config.MAX_RESIDENT_COLS)
    x, w, dy = jax_inputs(shape, dtype, 0.0, seed=1)
    check_jax(x, w, dy, KERNEL, eps=1e-6)


@gpu
@pytest.mark.parametrize("shape", [(256, 262144), (512, 65536)])
def test_gpu_carried_bands_match_float64_rule_and_read_again_bits(shape):
    """Bands whose blocks are carried to their finish in registers (``carry``; row groups, lag 1 and 2): the float64
    rule, and the bits of the same layout reading the band again."""
    x, w, dy = jax_inputs(shape, jnp.bfloat16, 0.0, seed=9)
    for cols, rows, lag, per_sm in ((2048, 2, 2, 4), (1024, 1, 1, 8)):
        carried = Config(rows, cols, 4, lag=lag, prefetch=True, carry=True,
                         programs=-(-shape[1] // cols) * max(1, per_sm * 132 // -(-shape[1] // cols)))
        check_jax(x, w, dy, KERNEL, eps=1e-6, config=carried, bwd_config=carried)
        again = dataclasses.replace(carried, carry=False)
        outs = [(*pn.rms_norm_with_rstd(x, w, eps=1e-6, impl=KERNEL, config=c), *_backward(x, w, dy, c, impl=KERNEL))
                for c in (again, carried)]
        for a, b in zip(*outs, strict=True):
            np.testing.assert_array_equal(bits(b), bits(a))


SMALL_SLOT_TILES = [Config(1, 1024, 4, lag=1, prefetch=True, programs=1024), Config(2, 2048, 4, lag=2, prefetch=True,
                                                                                 programs=512)]


@gpu
@pytest.mark.parametrize("config", SMALL_SLOT_TILES, ids=repr)
def test_gpu_slot_tiles_smaller_than_the_threads_match_float64_rule(config):
    """64 bands of one row (32 of two) on 4 warps, 16 row groups: without padding, the slot tile (64 slots) is held
    in replicas by 128 threads, polled at different times; that gave NaN rows in y, rstd and dx (H100)."""
    x, w, dy = jax_inputs((512, 65536), jnp.bfloat16, 0.0, seed=10)
    check_jax(x, w, dy, KERNEL, eps=1e-6, config=config, bwd_config=config)


@gpu
def test_gpu_replicated_slot_tiles_are_caught(monkeypatch):
    """The rule above catches the old width (the band count alone: replicated slot tiles)."""
    monkeypatch.setattr(band_slots, "slot_width", lambda bands_, rows, warps: pallas_config.next_pow2(bands_))
    x, w, dy = jax_inputs((512, 65536), jnp.bfloat16, 0.0, seed=11)
    config = dataclasses.replace(SMALL_SLOT_TILES[0], num_stages=1)  # a config traced only here
    with pytest.raises(AssertionError, match="y"):
        check_jax(x, w, dy, KERNEL, eps=1e-6, config=config, bwd_config=config)


@gpu
def test_gpu_band_forward_bits_repeat_and_do_not_depend_on_who_waited(monkeypatch):
    """y and rstd of five launches and of one where no program waits (``SPIN_LIMIT = 0``): the same bits; the
    fused add's h is the resident path's bits."""
    x, w, _ = jax_inputs((512, 262144), jnp.bfloat16, 0.0, seed=6)
    fwd = functools.partial(pn.rms_norm_with_rstd, impl="pallas")
    runs = [jax.jit(fwd)(x, w) for _ in range(5)]
    monkeypatch.setattr(band_slots, "SPIN_LIMIT", 0)
    runs.append(jax.jit(functools.partial(fwd, config=pallas_config.heuristic(512, 262144, backward=False)))(x, w))
    for y, rstd in runs[1:]:
        np.testing.assert_array_equal(bits(y), bits(runs[0][0]))
        np.testing.assert_array_equal(bits(rstd), bits(runs[0][1]))
    res = jax_inputs((512, 262144), jnp.bfloat16, 0.0, seed=7)[0]
    _, h = jax.jit(functools.partial(pn.rms_norm_add, impl="pallas"))(x, res, w)
    np.testing.assert_array_equal(bits(h), bits((x.astype(jnp.float32) + res.astype(jnp.float32)).astype(x.dtype)))


@gpu
def test_gpu_bands_bits_repeat_and_do_not_depend_on_who_waited(monkeypatch):
    """Five launches, then one where no program waits at all (``SPIN_LIMIT = 0``: whoever finds a block's slots
    incomplete recomputes them): the same bits every time."""
    x, w, dy = jax_inputs((512, 262144), jnp.bfloat16, 0.0, seed=2)
    config = pallas_config.heuristic(512, 262144, backward=True)
    runs = [jax.jit(functools.partial(_backward, config=config, impl="pallas"))(x, w, dy) for _ in range(5)]
    monkeypatch.setattr(band_slots, "SPIN_LIMIT", 0)
    runs.append(jax.jit(functools.partial(_backward, config=config, impl="pallas"))(x, w, dy))
    for dx, dw in runs[1:]:
        np.testing.assert_array_equal(bits(dx), bits(runs[0][0]))
        np.testing.assert_array_equal(bits(dw), bits(runs[0][1]))


@gpu
def test_gpu_bands_plain_and_fused_dweight_agree_and_torch_launch_route_matches_jax():
    """The fused add's backward on bands stores ``rms_norm``'s dweight bits; the Pallas binaries launched by torch
    (the slots filled per call by torch) give JAX's bits, forward and backward."""
    from torch_bridge import launch_route

    shape = (128, 262144)
    x0, w, dy = jax_inputs(shape, jnp.bfloat16, 0.0, seed=4)
    res = jax_inputs(shape, jnp.bfloat16, 0.0, seed=5)[0]
    (_, x), vjp = jax.vjp(lambda a, r, b: pn.rms_norm_add(a, r, b, impl="auto"), x0, res, w)
    _, _, dw_fused = vjp((dy, jnp.zeros_like(dy)))
    _, dx, dw = jax_vjp("auto", x, w, dy)  # the plain norm of h
    np.testing.assert_array_equal(bits(dw_fused), bits(dw))
    tx, tw, tdy = (torch.from_numpy(np.asarray(a.astype(jnp.float32))).to("cuda", torch.bfloat16) for a in (x, w, dy))
    t_y, rstd = launch_route.forward_launcher(*shape, tx.dtype, tw.dtype, 1e-6, 0.0, "llama", 0)(tx, tw)
    y, j_rstd = pn.rms_norm_with_rstd(x, w, eps=1e-6, impl="auto")
    np.testing.assert_array_equal(bits(t_y), bits(y))
    np.testing.assert_array_equal(bits(rstd), bits(j_rstd))
    t_dx, t_dw = launch_route.backward_launcher(*shape, tx.dtype, tw.dtype, 0.0, "llama", 0)(tx, tw, tdy, rstd)
    np.testing.assert_array_equal(bits(t_dx), bits(dx))
    np.testing.assert_array_equal(bits(t_dw), bits(dw))
