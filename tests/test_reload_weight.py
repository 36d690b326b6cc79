"""The Triton reference's resident backward loading the weight again for every row block
(``triton_config.Config.reload_weight``; the heuristic's tile for the backward of 16-bit rows of 16384,
``BWD_RESIDENT_RELOAD``): the held tile's dx and dweight bits, every casting, plain and the fused add's, with and
without g's 16-bit product (``low``), and the accuracy rule. Broken variant: a launch whose reloaded weight is the
weight rolled by one column, which both the bits and the rule catch."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from torch_bridge import triton_config, triton_kernels, triton_product
from torch_bridge.triton_config import Config

from helpers import judge, torch_inputs

CASTINGS = ("llama", "gemma", "none")
NEEDS = ((True, True), (True, False), (False, True))  # (dx, dweight)


def _same(got: tuple, want: tuple) -> bool:
    return all((a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
               for a, b in zip(got, want))


def _rolled_weight(monkeypatch) -> None:
    """Every launch with ``RELOAD_W`` reads the weight rolled by one column (the broken variant)."""
    launch = triton_kernels.triton_launch.launch

    def rolled(key, kernel, grid, args, meta, **kw):
        if meta().get("RELOAD_W"):
            key, args = ("rolled", *key), (args[0], torch.roll(args[1], 1), *args[2:])
        launch(key, kernel, grid, args, meta, **kw)

    monkeypatch.setattr(triton_kernels.triton_launch, "launch", rolled)


def _check(shape: tuple[int, int], dtype: torch.dtype, casting: str, held: Config, reload: Config, monkeypatch,
           seed: int) -> None:
    """``reload`` against ``held`` (the same grid) on random rows: plain and fused add, each of dx / dweight / both;
    then the broken variant."""
    offset = 1.0 if casting == "gemma" else 0.0
    kw = dict(offset=offset, casting=casting)
    x, w, dy = torch_inputs(shape, dtype, offset, seed=seed)
    dh_out = torch_inputs(shape, dtype, offset, seed=seed + 1)[2]
    y, rstd = triton_kernels.rms_norm_fwd(x, w, 1e-6, **kw)
    for add in ({}, dict(dh_out=dh_out)):
        for need in NEEDS:
            want = triton_kernels.rms_norm_bwd(dy, x, w, rstd, offset, casting, *need, config=held, **add)
            got = triton_kernels.rms_norm_bwd(dy, x, w, rstd, offset, casting, *need, config=reload, **add)
            assert _same(got, want), (casting, need, add.keys())
            full = (got, want) if need == NEEDS[0] else full
        assert judge(x, w, dy, (y, *full[0]), eps=1e-6, **add, **kw) == []
    _rolled_weight(monkeypatch)
    broken = triton_kernels.rms_norm_bwd(dy, x, w, rstd, offset, casting, True, True, config=reload, **add)
    assert not torch.equal(broken[0], full[1][0]) and judge(x, w, dy, (y, *broken), eps=1e-6, **add, **kw) != []


@pytest.mark.parametrize("casting", CASTINGS)
def test_reloading_the_weight_keeps_the_held_tile_s_bits(casting, monkeypatch):
    """A persistent grid of 2 programs over 37 rows in blocks of 4 (the last ragged), rows of 1000 in a 1024 tile
    (masked columns), prefetching."""
    held = Config(4, 1024, 4, programs_per_sm=1, one_program_elems=0, prefetch=True)
    _check((37, 1000), torch.bfloat16, casting, held, dataclasses.replace(held, reload_weight=True), monkeypatch, 37)


def test_the_heuristic_s_16384_tile_reloads_with_the_16_bit_product(monkeypatch):
    """float16 llama rows of 16384 take the heuristic's reloading tile with g a 16-bit multiply (``low``; under the
    interpreter float16 takes it, bfloat16 does not)."""
    tile = triton_config.backward_config(16384, triton_kernels.triton_launch.sm_count(torch.empty(0)), False, True)
    assert tile.reload_weight and triton_product.grad_in_dtype(torch.ones(16384, dtype=torch.float16),
                                                                 torch.float16, 0.0, "llama", 16384)
    _check((6, 16384), torch.float16, "llama", dataclasses.replace(tile, reload_weight=False), tile, monkeypatch, 6)


def test_reload_weight_is_an_option_of_the_resident_backward():
    """Asked where it does not apply (bands, pieces, the forward), it is refused with the reason, not ignored."""
    for bad in (dict(lag=2), dict(pieces=True), dict(l1_hints=True)):
        with pytest.raises(ValueError, match="reload_weight is an option of the resident backward"):
            Config(1, 1024, 4, reload_weight=True, **bad)
    with pytest.raises(ValueError, match="reload_weight must be a bool"):
        Config(1, 1024, 4, reload_weight=1)
    x, w, _ = torch_inputs((3, 1024), torch.bfloat16, 0.0, seed=3)
    with pytest.raises(ValueError, match="reload_weight is an option of the backward"):
        triton_kernels.rms_norm_fwd(x, w, 1e-6, 0.0, "llama", config=Config(1, 1024, 4, reload_weight=True))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("casting", CASTINGS)
def test_gpu_the_16384_tile_keeps_the_held_tile_s_bits(casting, dtype, monkeypatch):
    """On the GPU, the heuristic's tile at 4096×16384 (one program per SM, about 31 rows each) against the same tile
    holding the weight."""
    offset = 1.0 if casting == "gemma" else 0.0
    w = torch.ones(16384, dtype=dtype)
    low = triton_product.grad_in_dtype(w, dtype, offset, casting, 16384, 4096)
    tile = triton_config.backward_config(16384, torch.cuda.get_device_properties(0).multi_processor_count, False, low,
                                         4096)
    assert tile.reload_weight and tile.n_const and not tile.lag
    _check((4096, 16384), dtype, casting, dataclasses.replace(tile, reload_weight=False), tile, monkeypatch, 16384)
