"""The Triton reference with the row length a compile-time constant (``triton_config.Config.n_const``): the forward
of full rows of ``FWD_N_CONST``'s lengths and the resident backward of ``BWD_N_CONST``'s compile with N constant.
On full rows (nothing masked; the heuristics set it there only) that gives the run-time N's bits; on ragged rows it
still meets the accuracy rule. Broken variant throughout: a constant other than N (1000 for rows of 1024: rows read
at the wrong stride, their tails dropped), which the rule fails."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from torch_bridge import triton_config, triton_kernels, triton_product

from helpers import judge, torch_inputs, wrong_row_length_constant

CASTINGS = ("llama", "gemma", "none")


@pytest.mark.parametrize("casting", CASTINGS)
def test_forward_with_the_row_length_constant_keeps_the_bits(casting, monkeypatch):
    """The forward (and the fused add's) with ``n_const``: ragged (1000 of 1024) and full rows meet the rule, full
    rows with the run-time N's bits."""
    offset = 1.0 if casting == "gemma" else 0.0
    kw = dict(offset=offset, casting=casting)
    for n in (1000, 1024):
        x, w, dy = torch_inputs((5, n), torch.bfloat16, offset, seed=n)
        r = torch_inputs((5, n), torch.bfloat16, offset, seed=n + 1)[0]
        runtime = triton_config.Config(2, 1024, 4)
        const = dataclasses.replace(runtime, n_const=True)
        for add in ({}, dict(residual=r, h_dtype=torch.bfloat16)):
            want = triton_kernels.rms_norm_fwd(x, w, 1e-6, config=runtime, **add, **kw)
            got = triton_kernels.rms_norm_fwd(x, w, 1e-6, config=const, **add, **kw)
            rows = got[1] if add else x  # the fused add normalises h
            assert judge(rows, w, dy, (got[0],), eps=1e-6, only=("y",), **kw) == []
            if n == 1024:
                assert all(torch.equal(a, b) for a, b in zip(got, want))
    wrong_row_length_constant(monkeypatch)
    y = triton_kernels.rms_norm_fwd(x, w, 1e-6, config=const, **kw)[0]
    assert judge(x, w, dy, (y,), eps=1e-6, only=("y",), **kw) != []


@pytest.mark.parametrize("casting", CASTINGS)
def test_backward_with_the_row_length_constant_keeps_the_bits(casting, monkeypatch):
    """The resident backward with ``n_const`` over a persistent grid with a ragged last block (37 rows, 2 programs),
    plain and the fused add's (``dh_out``): ragged (1000 of 1024) and full rows meet the rule, full rows with the
    run-time N's dx and dweight bits."""
    offset = 1.0 if casting == "gemma" else 0.0
    kw = dict(offset=offset, casting=casting)
    runtime = triton_config.Config(4, 1024, 4, programs_per_sm=1, one_program_elems=0, prefetch=True)
    const = dataclasses.replace(runtime, n_const=True)
    for n in (1000, 1024):
        x, w, dy = torch_inputs((37, n), torch.bfloat16, offset, seed=n)
        dh_out = torch_inputs((37, n), torch.bfloat16, offset, seed=n + 1)[2]
        y, rstd = triton_kernels.rms_norm_fwd(x, w, 1e-6, **kw)
        for add in ({}, dict(dh_out=dh_out)):
            want = triton_kernels.rms_norm_bwd(dy, x, w, rstd, offset, casting, True, True, config=runtime, **add)
            got = triton_kernels.rms_norm_bwd(dy, x, w, rstd, offset, casting, True, True, config=const, **add)
            assert judge(x, w, dy, (y, *got), eps=1e-6, **add, **kw) == []
            if n == 1024:
                assert all(torch.equal(a, b) for a, b in zip(got, want))
    wrong_row_length_constant(monkeypatch)
    broken = triton_kernels.rms_norm_bwd(dy, x, w, rstd, offset, casting, True, True, config=const)
    assert judge(x, w, dy, (y, *broken), eps=1e-6, **kw) != []


def test_heuristics_set_it_on_full_rows_only():
    """The forward's plain tile at exactly 1024 columns (``FWD_N_CONST``); ``rms_norm``'s resident backward at exactly
    ``BWD_N_CONST``'s lengths (2048 up to 16384 rows); the backward of ``BWD_RESIDENT_RELOAD``'s (16384), the fused
    add's too; never ragged rows, the pieces (2304, 5120), longer rows or column bands."""
    fwd = {n for n in (1000, 1024, 2048, 4096) if triton_config.forward_config(n).n_const}
    assert fwd == {1024}
    widths = (512, 1000, 1024, 2048, 2304, 4096, 5120, 8192, 13000, 16384, 32768)
    for m, want in ((4096, {1024, 2048, 16384}), (16384, {1024, 2048, 16384}), (32768, {1024, 16384})):
        assert {n for n in widths if triton_config.backward_config(n, 132, False, True, m).n_const} == want
        assert {n for n in widths if triton_config.backward_config(n, 132, True, False, m).n_const} == {16384}
    with pytest.raises(ValueError, match="n_const is an option of rows held whole"):
        triton_config.Config(1, 1024, 1, lag=2, n_const=True)
    with pytest.raises(ValueError, match="n_const is an option of rows held whole"):
        triton_config.Config(1, 4096, 4, pieces=True, n_const=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(4096, 1024), (4096, 2048), (2048, 4096), (1024, 8192), (512, 16384)], ids=str)
def test_gpu_backward_row_length_constant_same_bits(shape, dtype):
    """On the GPU, the heuristic's backward tile with N constant against the same tile with run-time N: the same dx
    and dweight bits, plain and the fused add's (which the heuristic leaves at run-time N), llama (16-bit g where the
    dtype takes it) and gemma, at widths beyond ``BWD_N_CONST``'s too."""
    m, n = shape
    for casting, offset in (("llama", 0.0), ("gemma", 1.0)):
        x, w, dy = torch_inputs(shape, dtype, offset, seed=m + n)
        dh_out = torch_inputs(shape, dtype, offset, seed=m + n + 1)[2]
        rstd = triton_kernels.rms_norm_fwd(x, w, 1e-6, offset=offset, casting=casting)[1]
        for add in ({}, dict(dh_out=dh_out)):
            low = not add and triton_product.grad_in_dtype(w, dtype, offset, casting, n, m)
            tile = triton_config.backward_config(n, triton_kernels.triton_launch.sm_count(x), bool(add), low, m)
            if tile.lag:  # 16384 columns on bands: no resident tile
                continue
            runtime, const = (dataclasses.replace(tile, n_const=v) for v in (False, True))
            got = triton_kernels.rms_norm_bwd(dy, x, w, rstd, offset, casting, True, True, config=const, **add)
            want = triton_kernels.rms_norm_bwd(dy, x, w, rstd, offset, casting, True, True, config=runtime, **add)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), (casting, add.keys())
