"""The Triton reference's tiles on CPU (Triton's interpreter): its column-chunk paths, the backward's one program and
partials, balanced grid, prefetch and row-dtype product (no bits changed), and the heuristic's tables."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pallas_norm.semantics import CASTINGS
from torch_bridge import triton_config, triton_kernels, triton_product

from helpers import judge, torch_inputs


CHUNKED = triton_config.Config(block_m=1, block_n=256, num_warps=1, rowdot_block_n=256, rowdot_warps=1)


@pytest.mark.parametrize("n", [300, 1000])
@pytest.mark.parametrize("casting", CASTINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_column_chunk_paths(dtype, casting, n):
    """Long-row paths (two passes over column chunks, row-dot pre-pass in the backward) forced at small N by a
    config passed to the kernels."""
    assert CHUNKED.chunked(n) and not triton_config.backward_config(n).chunked(n)
    offset = 1.0 if casting == "gemma" else 0.0
    x, w, dy = torch_inputs((9, n), dtype, offset)
    kw = dict(offset=offset, casting=casting)
    y, rstd = triton_kernels.rms_norm_fwd(x, w, 1e-6, config=CHUNKED, **kw)
    dx, dw = triton_kernels.rms_norm_bwd(dy, x, w, rstd, offset, casting, True, True, config=CHUNKED)
    assert judge(x, w, dy, (y, dx, dw), eps=1e-6, **kw) == []


@pytest.mark.parametrize("casting", CASTINGS)
@pytest.mark.parametrize("one_program_elems", [0, triton_config.ONE_PROGRAM_ELEMS])
def test_backward_one_program_and_partials(monkeypatch, one_program_elems, casting):
    """A small backward runs one program per column chunk that stores dweight itself (one launch); with
    ``one_program_elems=0`` the same call takes the per-program partials and their reduction (two launches).
    Both match the float64 reference."""
    from torch_bridge import triton_launch

    offset = 1.0 if casting == "gemma" else 0.0
    x, w, dy = torch_inputs((40, 300), torch.bfloat16, offset)
    kw = dict(offset=offset, casting=casting)
    y, rstd = triton_kernels.rms_norm_fwd(x, w, 1e-6, **kw)
    launched = []
    real = triton_launch.launch
    monkeypatch.setattr(triton_launch, "launch", lambda key, *a, **k: (launched.append(key[0]), real(key, *a, **k)))
    config = dataclasses.replace(triton_config.backward_config(300), one_program_elems=one_program_elems)
    dx, dw = triton_kernels.rms_norm_bwd(dy, x, w, rstd, offset, casting, True, True, config=config)
    assert launched == (["bwd"] if one_program_elems else ["bwd", "dweight"])
    assert judge(x, w, dy, (y, dx, dw), eps=1e-6, **kw) == []


@pytest.mark.parametrize("shape,grid,unbalanced", [((80, 1024), 5, 6), ((40, 2304), 10, 12)], ids=["padded", "pieces"])
def test_backward_takes_the_balanced_grid(shape, grid, unbalanced, monkeypatch):
    """The resident backward's grid is ``pallas_config.balanced``'s (as the Pallas kernels'), on 3 SMs here: 20 row
    blocks of 4 rows (1024 columns) on at most 6 programs run as 5 of 4 blocks; 40 rows held as pieces (2304 = 2048
    + 256, one row per program, 4 programs per SM) on at most 12 run as 10 of 4. The fused add's backward runs on
    the same grid (its dweight is the plain one's bits), and all match the float64 reference. Broken variant (no
    balancing): 6 programs of 3 or 4 blocks, 12 of 3 or 4 rows."""
    from torch_bridge import triton_dweight, triton_launch

    monkeypatch.setattr(triton_launch, "sm_count", lambda x: 3)
    config = triton_config.backward_config(shape[1], 3)
    assert (config.block_m, config.pieces) == ((4, False) if shape[1] == 1024 else (1, True))
    x, w, dy = torch_inputs(shape, torch.bfloat16, 0.0, seed=3)
    dh_out = torch_inputs(shape, torch.bfloat16, 0.0, seed=5)[2]
    y, rstd = triton_kernels.rms_norm_fwd(x, w, 1e-6, 0.0, "llama")
    parts = []
    real = triton_dweight.reduce
    monkeypatch.setattr(triton_dweight, "reduce", lambda p, *a: (parts.append(p.shape[0]), real(p, *a)))
    dx, dw = triton_kernels.rms_norm_bwd(dy, x, w, rstd, 0.0, "llama", True, True)
    dw_fused = triton_kernels.rms_norm_bwd(dy, x, w, rstd, 0.0, "llama", True, True, dh_out=dh_out)[1]
    assert parts == [grid, grid] and torch.equal(dw, dw_fused)
    assert judge(x, w, dy, (y, dx, dw), eps=1e-6, offset=0.0, casting="llama") == []
    monkeypatch.setattr(triton_kernels, "balanced", lambda g, blocks: g)
    triton_kernels.rms_norm_bwd(dy, x, w, rstd, 0.0, "llama", True, True)
    assert parts == [grid, grid, unbalanced]


@pytest.mark.parametrize("casting", CASTINGS)
@pytest.mark.parametrize("config", [
    triton_config.Config(block_m=4, block_n=512, num_warps=2, programs_per_sm=1, one_program_elems=0),
    triton_config.Config(block_m=1, block_n=256, num_warps=1, programs_per_sm=1, one_program_elems=0,
                         rowdot_block_n=256, rowdot_warps=1)], ids=["resident", "chunked"])
def test_backward_prefetch_changes_no_bits(config, casting):
    """Loading the next row block before the current one's math (``prefetch``) gives the bits of the plain walk,
    over a persistent grid with a ragged last block (37 rows, 2 programs here); the result is also held to the
    float64 rule, which fails a block paired with its successor's rstd (what a prefetch off by one block does)."""
    offset = 1.0 if casting == "gemma" else 0.0
    x, w, dy = torch_inputs((37, 300), torch.bfloat16, offset, seed=4)
    kw = dict(offset=offset, casting=casting)
    y, rstd = triton_kernels.rms_norm_fwd(x, w, 1e-6, **kw)
    plain = triton_kernels.rms_norm_bwd(dy, x, w, rstd, offset, casting, True, True, config=config)
    fetched = triton_kernels.rms_norm_bwd(dy, x, w, rstd, offset, casting, True, True,
                                          config=dataclasses.replace(config, prefetch=True))
    for a, b in zip(plain, fetched):
        assert torch.equal(a, b)
    assert judge(x, w, dy, (y, *fetched), eps=1e-6, **kw) == []
    shifted = torch.cat([rstd[config.block_m:], rstd[:config.block_m]])  # every block sees its successor's rstd
    wrong = triton_kernels.rms_norm_bwd(dy, x, w, shifted, offset, casting, True, True,
                                        config=dataclasses.replace(config, prefetch=True))
    assert judge(x, w, dy, (y, *wrong), eps=1e-6, **kw) != []


def test_backward_heuristic_prefetches_resident_rows():
    """The resident backward prefetches for padded rows of 512 to 8192 columns (one program per SM at 8192) and
    16-bit per-head rows of 64 and 128 (``BWD_HEADS``: 4 warps, the fused add's too; float32 rows keep 8 warps
    without); 256 does not (8 warps), nor the fused add's of rows held as their pieces (2304, 5120: ``BWD_PIECES``),
    whose plain backward does (``BWD_PIECES_PLAIN``); longer rows than 8192 run on column bands, but for the backward
    of 16-bit rows of exactly 16384 (``BWD_RESIDENT_RELOAD``, the fused add's too) and ``rms_norm``'s of full rows of
    16384 padded columns where g is a 16-bit multiply (``BWD_RESIDENT_LOW``)."""
    picks = {n: (c.prefetch, c.programs_per_sm, c.num_warps) for n in (64, 96, 128, 256, 512, 2300, 2304, 5000, 5120,
                                                                       8192)
             for c in [triton_config.backward_config(n)]}
    assert picks == {64: (True, 2, 4), 96: (True, 2, 4), 128: (True, 2, 4), 256: (False, 2, 8), 512: (True, 2, 4),
                     2300: (True, 2, 8), 2304: (True, 4, 2), 5000: (True, 1, 16), 5120: (True, 2, 4),
                     8192: (True, 1, 16)}
    fused = {n: (c.prefetch, c.programs_per_sm, c.num_warps) for n in (64, 128, 256, 2304, 5120, 8192)
             for c in [triton_config.backward_config(n, fused=True)]}
    assert fused == {64: (True, 2, 4), 128: (True, 2, 4), 256: (False, 2, 8), 2304: (False, 4, 4),
                     5120: (False, 2, 8), 8192: (True, 1, 16)}
    for n in (64, 128):  # float32 rows keep 8 warps without prefetch (BWD_HEADS: 16-bit rows)
        assert {(c.num_warps, c.prefetch) for f in (False, True)
                for c in [triton_config.backward_config(n, 132, f, False, itemsize=4)]} == {(8, False)}
    assert triton_config.backward_config(10000).lag
    resident = triton_config.Config(1, 16384, 16, programs_per_sm=1)  # BWD_RESIDENT_LOW: full rows, plain, low
    assert triton_config.backward_config(13000, 132, False, True) == resident
    reload = dataclasses.replace(resident, n_const=True, reload_weight=True)  # BWD_RESIDENT_RELOAD: 16-bit rows
    assert triton_config.backward_config(16384, 132, False, True) == triton_config.backward_config(16384) == reload
    assert triton_config.backward_config(16384, 132, True) == reload  # the fused add's too
    for n, fused, low, itemsize in ((13000, False, False, 2), (13000, True, True, 2), (10000, False, True, 2),
                                    (16384, False, False, 4)):
        assert triton_config.backward_config(n, 132, fused, low, itemsize=itemsize).lag
    with pytest.raises(ValueError, match="prefetch"):
        triton_config.Config(block_m=1, block_n=256, num_warps=1, prefetch=1)


@pytest.mark.parametrize("casting,offset", [("llama", 0.0), ("none", 1.0)])
def test_backward_product_in_the_row_dtype_keeps_the_bits(casting, offset, monkeypatch):
    """Where dy and w_eff are both values of the row dtype (``triton_product.grad_in_dtype``), the backward's g =
    r(dy·w_eff) is one multiply in that dtype (``LOW``): the float32 product's bits, on the resident tile of rows held
    whole (16384 columns, one program per SM) and a persistent one; the accuracy rule holds. float16 here (the
    interpreter rounds it exactly; on the GPU bfloat16 takes it at every width, at 2048 columns up to 16384 rows and at
    256 up to 4096, ``BWD_LOW_MAX_ROWS``; float16 only where the row is then held whole, ``BWD_LOW_RESIDENT_DTYPES``).
    Broken variant: the same multiply for gemma (its g is the unrounded float32 product, its w_eff = w + 1 not a value
    of the dtype), which changes dx."""
    w16 = torch.ones(8, dtype=torch.bfloat16)
    on_gpu = not triton_kernels.INTERPRET
    assert triton_product.grad_in_dtype(w16, torch.bfloat16, 0.0, "llama", 1024) == on_gpu
    assert triton_product.grad_in_dtype(w16.half(), torch.float16, 0.0, "llama", 16384)
    assert not triton_product.grad_in_dtype(w16.half(), torch.float16, 0.0, "llama", 1024)
    assert not triton_product.grad_in_dtype(w16.half(), torch.float16, 0.0, "llama", 9000)  # padded: not held whole
    assert not triton_product.grad_in_dtype(w16.half(), torch.float16, 1.0, "gemma", 16384)
    monkeypatch.setattr(triton_product, "BWD_LOW_DTYPES", (torch.float16,))
    rows = {(n, m) for n in (256, 1024, 2048) for m in (0, 4096, 16384, 32768)
            if triton_product.grad_in_dtype(w16.half(), torch.float16, 0.0, "llama", n, m)}
    assert rows == {(256, 0), (256, 4096), (1024, 0), (1024, 4096), (1024, 16384), (1024, 32768), (2048, 0),
                    (2048, 4096), (2048, 16384)}  # BWD_LOW_MAX_ROWS
    configs = (triton_config.Config(1, 16384, 16, programs_per_sm=1), triton_config.Config(2, 512, 2))
    for n, config in zip((16384, 300), configs):
        x, w, dy = torch_inputs((5, n), torch.float16, offset, seed=n)
        kw = dict(offset=offset, casting=casting)
        y, rstd = triton_kernels.rms_norm_fwd(x, w, 1e-6, **kw)
        low = triton_kernels.rms_norm_bwd(dy, x, w, rstd, offset, casting, True, True, config=config)
        with monkeypatch.context() as patch:
            patch.setattr(triton_product, "BWD_LOW_DTYPES", ())
            patch.setattr(triton_product, "BWD_LOW_RESIDENT_DTYPES", ())
            wide = triton_kernels.rms_norm_bwd(dy, x, w, rstd, offset, casting, True, True, config=config)
        assert all(torch.equal(a, b) for a, b in zip(low, wide))
        assert judge(x, w, dy, (y, *low), eps=1e-6, **kw) == []
    x, w, dy = torch_inputs((5, 300), torch.float16, 1.0, seed=3)
    gemma = dict(offset=1.0, casting="gemma")
    rstd = triton_kernels.rms_norm_fwd(x, w, 1e-6, **gemma)[1]
    want = triton_kernels.rms_norm_bwd(dy, x, w, rstd, 1.0, "gemma", True, True, config=configs[1])
    monkeypatch.setattr(triton_product, "output_in_dtype", lambda *a: True)
    broken = triton_kernels.rms_norm_bwd(dy, x, w, rstd, 1.0, "gemma", True, True, config=configs[1])
    assert not torch.equal(broken[0], want[0])


def test_forward_tiles_full_rows_by_the_table():
    """Full rows of ``FWD_RESIDENT``'s lengths take its tile (the fused add ``FWD_ADD_RESIDENT``'s at 1024; N constant
    in the plain forward's of exactly 1024 only); padded rows (2304 of 4096, 1536 of 2048) and the other lengths keep
    the ``TILE_ELEMS`` rule (a warp per 1024 tile elements); 16-bit rows of 5120 columns take the two-pass walk
    (``tests/test_two_pass.py``), 4-byte ones the rule."""
    widths = (1000, 1024, 1536, 2048, 2304, 3584, 4096, 5120, 8192, 16384)
    tiles = {n: (c.block_m, c.block_n, c.num_warps, c.n_const) for n in widths
             for c in [triton_config.forward_config(n, itemsize=4)]}
    assert tiles == {1000: (2, 1024, 4, False), 1024: (2, 1024, 4, True), 1536: (2, 2048, 4, False),
                     2048: (1, 2048, 8, False), 2304: (1, 4096, 4, False), 3584: (1, 4096, 8, False),
                     4096: (1, 4096, 8, False), 5120: (1, 8192, 8, False), 8192: (1, 8192, 16, False),
                     16384: (1, 16384, 16, False)}
    fused = {n: triton_config.forward_config(n, itemsize=4, fused=True) for n in widths}
    assert fused[1024] == fused[1000] == triton_config.Config(4, 1024, 4, l1_hints=True)
    assert all(fused[n] == triton_config.forward_config(n, itemsize=4) for n in widths if n > 1024)
    assert {n: triton_config.forward_config(n) for n in widths if n != 5120} == {
        n: triton_config.forward_config(n, itemsize=4) for n in widths if n != 5120}


def test_bad_config():
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        triton_config.Config(block_m=1, block_n=300, num_warps=4)
