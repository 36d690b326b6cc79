"""The Triton reference's resident backward on rows held as their two power-of-two pieces (``triton_config.Config``'s
``pieces``, ``torch_bridge/triton_pieces.py``): the accuracy rule in every mode, dweight's bits against the padded
kernel on the same grid, the fused add, the heuristic and where a config may ask for it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from torch_bridge import triton_config, triton_kernels, triton_launch, triton_pieces

from helpers import judge, torch_inputs

Config = triton_config.Config
PIECES = Config(1, 4096, 4, programs_per_sm=3, one_program_elems=0, pieces=True)  # 2304 = 2048 + 256: 6 programs


def _backward(x, w, dy, offset, casting, config, **kw):
    """``(y, dx, dweight)``: the heuristic's forward, then the backward under ``config``."""
    y, rstd = triton_kernels.rms_norm_fwd(x, w, 1e-6, offset, casting)
    return (y, *triton_kernels.rms_norm_bwd(dy, x, w, rstd, offset, casting, True, w is not None, config=config, **kw))


@pytest.mark.parametrize("shape,config,dtype,casting,offset,weight", [
    ((37, 2304), PIECES, torch.bfloat16, "llama", 0.0, True),
    ((37, 2304), dataclasses.replace(PIECES, block_m=2, prefetch=True), torch.float16, "gemma", 1.0, True),
    ((21, 1280), Config(2, 2048, 4, programs_per_sm=2, one_program_elems=0, pieces=True), torch.float32, "none", 0.0,
     True),
    ((21, 1280), Config(1, 2048, 2, programs_per_sm=2, one_program_elems=0, pieces=True), torch.bfloat16, "llama",
     0.0, False),
    ((9, 320), Config(1, 512, 2, pieces=True), torch.bfloat16, "gemma", 1.0, True),  # one program stores dweight
    ((9, 320), Config(1, 512, 2, programs_per_sm=2, one_program_elems=0, pieces=True), torch.float64, "llama", 0.0,
     True),
])
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_pieces_backward_accuracy(shape, config, dtype, casting, offset, weight, fused):
    """The pieces (2304: 2048 + 256; 1280: 1024 + 256; 320: 256 + 64) against the float64 reference in every casting
    mode and dtype, with and without a weight, two rows per program, prefetching, one program storing dweight itself;
    ``fused``: the fused add's backward, dx = r(dx_norm + dh_out)."""
    x, w, dy = torch_inputs(shape, dtype, offset, seed=shape[1])
    dh = torch_inputs(shape, dtype, offset, seed=shape[1] + 1)[2] if fused else None
    w = w if weight else None
    out = _backward(x, w, dy, offset, casting, config, dh_out=dh)
    assert judge(x, w, dy, out, eps=1e-6, offset=offset, casting=casting, dh_out=dh) == []


def test_a_dropped_piece_is_caught(monkeypatch):
    """Broken variant: a kernel that holds only half of the row's second piece (the rest of the row left out of the
    row sum, dx and dweight) fails the accuracy rule."""
    x, w, dy = torch_inputs((35, 2304), torch.bfloat16, 0.0, seed=1)
    real = triton_pieces.two_pieces
    monkeypatch.setattr(triton_pieces, "two_pieces", lambda n: (real(n)[0], real(n)[1] // 2))
    assert judge(x, w, dy, _backward(x, w, dy, 0.0, "llama", PIECES), eps=1e-6) != []


@pytest.mark.parametrize("casting,offset", [("llama", 0.0), ("gemma", 1.0)])
def test_dweight_is_the_padded_kernel_s_bits(casting, offset, monkeypatch):
    """On the same grid (one row per program) the pieces add each column's terms in the padded kernel's order: the
    same dweight bits (a float32 weight shows every float32 rounding), also for the fused add's backward (which
    reads dh_out too). Broken variant: another grid (4 programs) gives other bits. Two SMs, as off a GPU, so that
    the grids are these on a GPU too (132 SMs would give both 37 programs)."""
    monkeypatch.setattr(triton_launch, "sm_count", lambda x: 2)
    x, w, dy = torch_inputs((37, 2304), torch.bfloat16, offset, seed=5, weight_dtype=torch.float32)
    dh = torch_inputs((37, 2304), torch.bfloat16, offset, seed=6)[2]
    pieces = _backward(x, w, dy, offset, casting, PIECES)[2]
    padded = _backward(x, w, dy, offset, casting, dataclasses.replace(PIECES, num_warps=8, pieces=False))[2]
    fused = _backward(x, w, dy, offset, casting, PIECES, dh_out=dh)[2]
    assert torch.equal(pieces, padded) and torch.equal(fused, pieces)
    other = _backward(x, w, dy, offset, casting, dataclasses.replace(PIECES, programs_per_sm=2))[2]
    assert not torch.equal(other, pieces)


def test_heuristic_takes_pieces_at_the_table_s_widths():
    """``BWD_PIECES``' widths take one-row programs of pieces at the table's tile (the fused add's; ``rms_norm``'s
    on ``BWD_PIECES_PLAIN``'s warps and prefetch, the same grid); halves of a power of two, powers of two and other
    widths keep the padded tile."""
    tiles = {n: (c.block_m, c.num_warps, c.programs_per_sm, c.prefetch) for n in (2304, 2560, 5120)
             for c in [triton_config.backward_config(n, 132, fused=True)] if c.pieces}
    assert tiles == {n: (1, *triton_config.BWD_PIECES[n]) for n in (2304, 2560, 5120)}
    for n in (2304, 2560, 5120):
        plain, fused = (triton_config.backward_config(n, 132, fused=f) for f in (False, True))
        assert (plain.num_warps, plain.prefetch) == triton_config.BWD_PIECES_PLAIN[n]
        assert dataclasses.replace(plain, num_warps=fused.num_warps, prefetch=fused.prefetch) == fused
    for n in (1536, 3072, 6144, 2048, 4096, 2300, 1000, 3584, 16384):
        assert not triton_config.backward_config(n, 132).pieces, n


def test_the_fused_add_s_tile_follows_the_weight_s_product_on_the_h200(monkeypatch):
    """On the H200 the fused add's backward of 2304 with the weight's product in the row dtype (Llama's) runs the
    plain backward's tile (``BWD_PIECES_FUSED_LOW_BY_MODEL``: 2 warps, prefetching, the same grid); Gemma's product,
    other widths and other GPUs keep ``BWD_PIECES``'. The launcher asks for it with the GPU's model and the product
    (float16 here: the interpreter rounds bfloat16 products otherwise)."""
    fused = lambda n, low, model: triton_config.backward_config(n, 132, True, low, 0, 2, model)
    plain = triton_config.backward_config(2304, 132, False, False, 0, 2, "h200")
    assert fused(2304, True, "h200") == plain and plain.num_warps == 2 and plain.prefetch
    for n, low, model in ((2304, False, "h200"), (2304, True, ""), (2560, True, "h200")):
        config = fused(n, low, model)
        assert (config.num_warps, config.programs_per_sm, config.prefetch) == triton_config.BWD_PIECES[n]
    asked = []
    real = triton_config.backward_config
    monkeypatch.setattr(triton_config, "backward_config", lambda *a: asked.append(a) or real(*a))
    monkeypatch.setattr(triton_launch, "gpu_model", lambda x: "h200")
    for casting, offset in (("llama", 0.0), ("gemma", 1.0)):
        x, w, dy = torch_inputs((3, 2304), torch.float16, offset, seed=5)
        _backward(x, w, dy, offset, casting, None, dh_out=dy)
    fused_asked = [(a[3], a[6]) for a in asked if a[2]]
    assert fused_asked == [(True, "h200"), (False, "h200")]


def test_plain_and_fused_add_tiles_give_one_dweight(monkeypatch):
    """``rms_norm``'s backward and the fused add's run other warps and prefetching on one grid (one row per program
    at a time): the same dweight bits, shown under the interpreter, where prefetching moves the loads (several rows
    per program here; two SMs, as off a GPU, on a GPU too). Broken variant: the plain tile on another grid gives
    other bits."""
    monkeypatch.setattr(triton_launch, "sm_count", lambda x: 2)
    x, w, dy = torch_inputs((21, 5120), torch.bfloat16, 0.0, seed=3, weight_dtype=torch.float32)
    dh = torch_inputs((21, 5120), torch.bfloat16, 0.0, seed=4)[2]
    plain = _backward(x, w, dy, 0.0, "llama", None)[2]
    fused = _backward(x, w, dy, 0.0, "llama", None, dh_out=dh)[2]
    assert torch.equal(fused, plain)
    elsewhere = dataclasses.replace(triton_config.backward_config(5120, 132), programs_per_sm=1)
    assert not torch.equal(_backward(x, w, dy, 0.0, "llama", elsewhere)[2], plain)


def test_pieces_only_tile_the_resident_backward_of_two_pieces():
    """A config asking for pieces where they do not apply (the forward; rows of one or three pieces; a backward
    walking column chunks) is refused with the reason, not ignored."""
    x, w, dy = torch_inputs((3, 2304), torch.bfloat16)
    with pytest.raises(ValueError, match="pieces is an option of the backward"):
        triton_kernels.rms_norm_fwd(x, w, 1e-6, 0.0, "llama", config=PIECES)
    rstd = triton_kernels.rms_norm_fwd(x, w, 1e-6, 0.0, "llama")[1]
    with pytest.raises(ValueError, match="held whole"):
        triton_kernels.rms_norm_bwd(dy, x, w, rstd, 0.0, "llama", True, True, config=Config(1, 1024, 4, pieces=True))
    for n, sums in ((2048, "2048"), (3584, "2048 \\+ 1024 \\+ 512")):
        x, w, dy = torch_inputs((3, n), torch.bfloat16)
        rstd = triton_kernels.rms_norm_fwd(x, w, 1e-6, 0.0, "llama")[1]
        with pytest.raises(ValueError, match=f"two power-of-two pieces .*{n} columns \\({sums}\\)"):
            triton_kernels.rms_norm_bwd(dy, x, w, rstd, 0.0, "llama", True, True, config=PIECES)
    with pytest.raises(ValueError, match="pieces must be a bool"):
        Config(1, 1024, 4, pieces=1)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,casting,offset,weight_dtype", [
    (4096, 2304, "llama", 0.0, torch.float32), (1000, 5120, "gemma", 1.0, torch.float32),
    (4099, 2560, "none", 0.0, torch.float32), (8, 2304, "llama", 0.0, torch.float32),
    (4096, 2304, "llama", 0.0, torch.bfloat16), (4096, 2304, "gemma", 1.0, torch.bfloat16)])
def test_gpu_pieces(m, n, casting, offset, weight_dtype):
    """The compiled heuristic (pieces at these widths, one program at 8 rows), plain and fused add, against the
    float64 reference; dweight the same bits over repeated calls and the fused add's the same as the plain one's
    (a bfloat16 weight: on the H200 Llama's fused add takes the plain backward's tile, Gemma's not)."""
    assert triton_config.backward_config(n, 132).pieces
    x, w, dy = torch_inputs((m, n), torch.bfloat16, offset, seed=m + n, weight_dtype=weight_dtype, device="cuda")
    dh = torch_inputs((m, n), torch.bfloat16, offset, seed=m + n + 1, device="cuda")[2]
    out = _backward(x, w, dy, offset, casting, None)
    assert judge(x, w, dy, out, eps=1e-6, offset=offset, casting=casting) == []
    assert torch.equal(_backward(x, w, dy, offset, casting, None)[2], out[2])
    fused = _backward(x, w, dy, offset, casting, None, dh_out=dh)
    assert judge(x, w, dy, fused, eps=1e-6, offset=offset, casting=casting, dh_out=dh) == []
    assert torch.equal(fused[2], out[2])
