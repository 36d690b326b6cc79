"""The Triton reference's forward tiles on an H200 (``triton_config.FWD_RESIDENT_BY_MODEL``): 16-bit rows of exactly
its widths held whole on its (rows, warps, N constant or not), plain and fused add alike, where two passes do not
take them. On CPU the table's choice and the rule (Triton's interpreter); on any GPU the fused add's y and rstd are
``rms_norm(h)``'s bits on each tile."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from torch_bridge import triton_config, triton_kernels

from helpers import judge, torch_inputs, wrong_row_length_constant

TABLE = triton_config.FWD_RESIDENT_BY_MODEL["h200"]
SMS = 132


def _tile(n: int, low: bool, m: int, fused: bool, model: str = "h200", itemsize: int = 2) -> tuple:
    c = triton_config.forward_config(n, SMS, itemsize, low, m, fused, model)
    return (c.block_m, c.block_n, c.num_warps, c.n_const) if not c.chunked(n) else ("two passes", c.block_n)


def test_h200_takes_the_table_for_16_bit_rows_of_its_widths():
    """Both products (llama's in the row dtype, gemma's float32), plain and fused add, 4096 and 32768 rows: the table's
    tile, except where two passes take them: Gemma's 4096×5120 (``ffi_tables.FWD_FFI_TWO_PASS_BY_MODEL``) and
    Gemma's plain forward of 8192 and 16384 (``FWD_FFI_TWO_PASS_PLAIN_BY_MODEL``). Not on other models, not for
    float32 rows, not at other widths (2300, 5000: the general rule)."""
    two_passes = {(5120, 4096, False): 4096, (5120, 4096, True): 4096} | {
        (n, m, False): n // 2 for n in (8192, 16384) for m in (4096, 32768)}
    for n, (rows, warps, n_const) in TABLE.items():
        want = (rows, triton_config.next_pow2(n), warps, n_const)
        for low in (True, False):
            for m in (4096, 32768):
                for fused in (False, True):
                    chunk = None if low else two_passes.get((n, m, fused))
                    assert _tile(n, low, m, fused) == (("two passes", chunk) if chunk else want), (n, low, m, fused)
    for n in TABLE:
        for model, itemsize in (("h100", 2), ("", 2), ("h200", 4)):
            assert _tile(n, True, 32768, False, model, itemsize) == _tile(n, True, 32768, False, "", itemsize)
    for n in (2300, 5000):
        assert _tile(n, True, 32768, False) == _tile(n, True, 32768, False, "")


def _table_config(n: int) -> triton_config.Config:
    """The table's tile for rows of ``n`` columns, as ``forward_config`` builds it."""
    rows, warps, n_const = TABLE[n]
    return triton_config.Config(rows, triton_config.next_pow2(n), warps, l1_hints=True, n_const=n_const)


@pytest.mark.parametrize("casting", ["llama", "gemma"])
def test_table_tiles_meet_the_rule(casting, monkeypatch):
    """Every tile of the table, plain and fused add (ragged rows of 2304, 3584 and 5120 with N constant among them),
    against the float64 reference; the fused add's y normalises h. Broken variant: a row length constant of 2300 at
    2304 columns (each row's last 4 columns dropped from its sum and left unwritten), which the rule fails."""
    offset = 1.0 if casting == "gemma" else 0.0
    kw = dict(offset=offset, casting=casting)
    for n in TABLE:
        cfg = _table_config(n)
        x, w, dy = torch_inputs((5, n), torch.bfloat16, offset, seed=n)
        r = torch_inputs((5, n), torch.bfloat16, offset, seed=n + 1)[0]
        y, rstd = triton_kernels.rms_norm_fwd(x, w, 1e-6, config=cfg, **kw)
        assert judge(x, w, dy, (y,), eps=1e-6, only=("y",), **kw) == [], n
        y_add, h, _ = triton_kernels.rms_norm_fwd(x, w, 1e-6, config=cfg, residual=r, h_dtype=torch.bfloat16, **kw)
        assert judge(h, w, dy, (y_add,), eps=1e-6, only=("y",), **kw) == [], n
    cfg = triton_config.Config(1, 4096, 4, l1_hints=True, n_const=True)
    x, w, dy = torch_inputs((5, 2304), torch.bfloat16, offset, seed=7)
    wrong_row_length_constant(monkeypatch, 2300)
    y = triton_kernels.rms_norm_fwd(x, w, 1e-6, config=cfg, **kw)[0]
    assert judge(x, w, dy, (y,), eps=1e-6, only=("y",), **kw) != []


@pytest.mark.gpu
@pytest.mark.parametrize("casting", ["llama", "gemma"])
@pytest.mark.parametrize("n", sorted(TABLE))
def test_gpu_fused_add_keeps_rms_norm_of_h_bits_on_the_table_tile(n, casting):
    """On the GPU, 8192 bf16 rows on the table's tile (forced, so any GPU checks it; an H200's heuristic takes it):
    the fused add's y and rstd are ``rms_norm(h)``'s bits, and y meets the rule. Broken variant: the fused add on one
    warp (each thread sums a quarter or more of the row), whose bits differ."""
    offset = 1.0 if casting == "gemma" else 0.0
    kw = dict(offset=offset, casting=casting)
    cfg = _table_config(n)
    x, w, dy = torch_inputs((8192, n), torch.bfloat16, offset, seed=n)
    r = torch_inputs((8192, n), torch.bfloat16, offset, seed=n + 1)[0]
    if triton_kernels.triton_launch.gpu_model(x) == "h200" and (n, casting) != (5120, "gemma"):
        assert triton_config.forward_config(n, SMS, 2, casting == "llama", 8192, True, "h200") == cfg
    y, h, rstd = triton_kernels.rms_norm_fwd(x, w, 1e-6, config=cfg, residual=r, h_dtype=torch.bfloat16, **kw)
    y_h, rstd_h = triton_kernels.rms_norm_fwd(h, w, 1e-6, config=cfg, **kw)
    assert torch.equal(y, y_h) and torch.equal(rstd, rstd_h)
    assert judge(h[:512], w, dy[:512], (y[:512],), eps=1e-6, only=("y",), **kw) == []
    one_warp = dataclasses.replace(cfg, num_warps=1)
    y_b, _, rstd_b = triton_kernels.rms_norm_fwd(x, w, 1e-6, config=one_warp, residual=r, h_dtype=torch.bfloat16,
                                                 **kw)
    assert not (torch.equal(y_b, y_h) and torch.equal(rstd_b, rstd_h))
