"""Column bands' layout (``pallas_norm/bands.py``, ``band_slots.py``, ``pallas_config.bands_config``), checked on
CPU: the slots per row, which rows take bands, what the heuristic's band kernels compile to for sm_90 (no shared
memory), and how the lowered module hands the torch launch route its slots."""

from __future__ import annotations

import dataclasses
import re

import jax.numpy as jnp
import pytest
import torch

from pallas_norm import band_slots, band_tables, pallas_config, triton_ffi
from pallas_norm.pallas_config import Config
from pallas_norm.rounding import rounder

from helpers import abstract_h100


def test_slot_tiles_hold_four_slots_per_thread():
    """A block's slot tile (``block_rows`` × slots per row) holds at least ``SLOTS_PER_THREAD`` slots per thread of its
    program, so no slot is polled by two threads (replicas can disagree: NaN rows on the H100, see ``slot_width``);
    the band count alone (the old width) is not enough for 64 bands of one row on 4 warps."""
    for bands_, rows, warps in ((64, 1, 4), (32, 2, 4), (3, 1, 1), (128, 2, 4), (300, 1, 8), (16, 64, 2)):
        width = band_slots.slot_width(bands_, rows, warps)
        assert width >= bands_ and width & (width - 1) == 0
        assert width * rows >= band_slots.SLOTS_PER_THREAD * band_slots.WARP * warps
    assert pallas_config.next_pow2(64) * 1 < band_slots.WARP * 4  # the old width, broken for the first layout
    config = pallas_config.fit(Config(1, 1024, 4, lag=1, programs=1024), 512, 65536, backward=False)
    assert band_slots.slot_cols(config, 65536) == 512 and band_slots.slots(512, 65536, config).shape == (512, 512)


@pytest.mark.parametrize("backward", [False, True])
def test_heuristic_takes_bands_for_long_rows(backward, monkeypatch):
    """For an H100's 132 SMs (and a GPU of 114): bands for the backward beyond 8192 columns and the forward beyond the
    16384 it holds, at most ``BANDS_MAX_PER_SM`` per SM, in row groups; rows with more bands per SM stay chunked, and
    a backward small enough for one program stays one program."""
    from pallas_norm import backend

    first = 8193 if backward else 16385
    monkeypatch.setattr(backend, "gpu_model", lambda: "")  # the tables without a model's entries (an H200 has some)
    monkeypatch.setattr(pallas_config, "_available", lambda: False)  # nor jaxlib's Triton call (a GPU's forward)
    for sms in (132, 114):
        monkeypatch.setattr(backend, "num_sms", lambda sms=sms: sms)
        per_sm = (band_tables.BANDS if backward else band_tables.FWD_BANDS)[-1]
        for n in (first, 20000, 32768, 131072, 262144, 300000):
            config = pallas_config.heuristic(1024, n, backward=backward)
            assert config.lag and config.chunks(n) <= band_tables.BANDS_MAX_PER_SM * sms
            slots = per_sm * sms - band_tables.BANDS_SPARE  # some left free for other streams' kernels
            assert band_slots.groups(config, n) * config.chunks(n) == config.programs <= slots
        assert not pallas_config.heuristic(1024, first - 1, backward=backward).lag
        assert bool(pallas_config.heuristic(2, 32768, backward=backward).lag) != backward  # one program: one launch
        longest = band_tables.BANDS_MAX_PER_SM * sms * config.block_cols
        assert pallas_config.heuristic(16, longest, backward=backward).lag
        assert not pallas_config.heuristic(16, longest + 1, backward=backward).lag
    assert not pallas_config.fit(Config(4, 1024, 4, lag=2), 8, 1000, backward=backward).lag  # a resident row
    with pytest.raises(ValueError, match="lag"):
        Config(1, 1024, 4, lag=-1)


@pytest.mark.parametrize("backward", [False, True])
def test_heuristic_band_kernels_need_no_shared_memory(backward, monkeypatch):
    """The heuristic's band programs are one warp: no cross-warp reduction, no shared memory, so XLA launches them at
    the driver's carveout (it asks the most shared memory, the least L1, of every kernel using any; ``bench
    carveout``). Compiled for sm_90 from the TTIR XLA receives, at 262144 columns and on bands of 65536 (64 bands:
    a slot tile of 2 slots per thread took 128 bytes to convert its layout). Broken variants: a 4-warp band config,
    and the slots at 1 per thread."""
    pytest.importorskip("triton")
    from pallas_norm import backend
    from torch_bridge import launch_route

    monkeypatch.setattr(backend, "num_sms", lambda: 132)

    def shared(shape, config):
        lower = launch_route._lower_backward if backward else launch_route._lower_forward
        args = (torch.bfloat16, torch.bfloat16) + ((0.0,) if backward else (1e-6, 0.0)) + ("llama", config)
        with abstract_h100():
            call = launch_route.parse_program(lower(*shape, *args).compiler_ir("stablehlo")).calls[0]
        return triton_ffi.triton_binary(call.ttir, 90, config.num_warps, 3).metadata.shared

    config = pallas_config.heuristic(64, 262144, backward=backward)
    assert config.lag and config.num_warps == 1 and shared((64, 262144), config) == 0
    assert shared((64, 262144), dataclasses.replace(config, num_warps=4)) > 0
    short = pallas_config.bands_config(64, 65536, backward=backward, min_cols=0)
    assert short.num_warps == 1 and short.chunks(65536) == 64 and shared((64, 65536), short) == 0
    monkeypatch.setattr(band_slots, "SLOTS_PER_THREAD", 1)  # 64 slots for 32 threads; another shape: traced afresh
    assert shared((32, 65536), pallas_config.bands_config(32, 65536, backward=backward, min_cols=0)) > 0


def test_torch_launch_route_fills_the_slots_per_call():
    """The module lowered for an (abstract) H100 holds the slots as a splat constant aliased to the kernel's last
    result: the launch route reads it as a buffer filled per call (``UNPOSTED``) and written in place; a kernel
    writing into one of the caller's inputs is refused (the DLPack route runs it instead)."""
    from torch_bridge import launch_route, xla_program

    config = Config(4, 1024, 4, lag=2, prefetch=True)
    lower = {"fwd": lambda: launch_route._lower_forward(64, 262144, torch.bfloat16, torch.bfloat16, 1e-6, 0.0, "llama",
                                                        config),
             "bwd": lambda: launch_route._lower_backward(64, 262144, torch.bfloat16, torch.bfloat16, 0.0, "llama",
                                                         config)}
    for mode, lowering in lower.items():
        with abstract_h100():
            lowered = lowering()
        program = launch_route.parse_program(lowered.compiler_ir("stablehlo"))
        (call,) = program.calls
        assert call.name == f"pallas_norm_{mode}_bands" and call.grid == (256, 1, 1)
        ((value, shape, dtype, fill),) = program.fills
        assert (shape, dtype, fill) == ((64, 256), torch.int32, float(band_slots.UNPOSTED))
        assert call.aliases == ((2, call.operands.index(value)),) and program.outputs == call.results[:2]
    module = lowered.compiler_ir("stablehlo")
    main = next(op for op in module.body.operations if op.attributes["sym_name"].value == "main")
    op = next(op for op in main.regions[0].blocks[0].operations if op.operation.name == "stablehlo.custom_call")
    with pytest.raises(launch_route.UnsupportedProgram, match="writing into an input"):
        xla_program._aliases(op, list(range(len(op.operands))), fills={})  # the same aliasing, no filled value


def test_band_backward_multiplies_g_in_the_row_dtype(monkeypatch):
    """Where the backward may take g = r(dy·w_eff) as one multiply in the row dtype (``tiles.grad_in_dtype``: Llama's
    casting, 16-bit rows, the weight in their dtype), the band backward does, plain and fused add: its TTIR multiplies
    bf16 tiles (the start's row sum, the finish's dx and the fallback's peer sums, in each loop of the walk; one bf16x2
    instruction per pair on sm_90, the float32 product's bits). H200: +5-8% at 32768-262144 columns, the band backward
    being bound by its instruction stream (``bands._bwd_kernel``). Gemma's casting keeps the float32 product. Broken
    variant: the choice turned off (``bands.grad_in_dtype`` patched), no bf16 multiply left."""
    from pallas_norm import backend, bands
    from torch_bridge import launch_route

    monkeypatch.setattr(backend, "num_sms", lambda: 132)

    def bf16_products(m: int, casting: str, fused: bool) -> int:
        """The bf16 multiplies in the backward's TTIR (``m`` rows of 262144: each (m, casting, fused) traced afresh)."""
        config = pallas_config.heuristic(m, 262144, backward=True)
        offset = 1.0 if casting == "gemma" else 0.0
        with abstract_h100():
            lowered = launch_route._lower_backward(m, 262144, torch.bfloat16, torch.bfloat16, offset, casting, config,
                                                   fused)
        ttir = launch_route.parse_program(lowered.compiler_ir("stablehlo")).calls[0].ttir
        return len(re.findall(r"arith\.mulf .*bf16>", ttir))

    assert bf16_products(64, "llama", False) >= 3 and bf16_products(64, "llama", True) >= 3
    assert bf16_products(64, "gemma", False) == 0
    monkeypatch.setattr(bands, "grad_in_dtype", lambda *args, **kw: False)
    assert bf16_products(32, "llama", False) == 0


def test_band_backward_takes_pair_ops_for_bf16(monkeypatch):
    """Compiled, the bf16 band backward widens and rounds as pairs and fuses its multiply-adds (``backend.RowOps``;
    H200 +1.9-4.5%): its TTIR carries the PTX, ``fma.rn.f32`` (dweight's sum, dx; in each loop of the walk) alike
    for both castings, Llama's ``cvt.rn.bf16x2.f32`` (n rounded; Gemma rounds nothing), and fp16's none of it. Casting
    "none" lowers: its ``r(rstd)`` on a ``(rows, 1)`` column takes the plain rounding. Broken variants: ``row_ops``
    patched to the plain ops, no PTX left; pairs asked of the column, refused by Triton's verifier (as the GPU's first
    run of the change was, at 3×65537)."""
    from pallas_norm import backend
    from torch_bridge import launch_route

    monkeypatch.setattr(backend, "num_sms", lambda: 132)

    def ptx(m: int, casting: str, fused: bool, dtype=torch.bfloat16) -> tuple[int, int, int]:
        """(fma, cvt.rn.bf16x2, shl.b32) in the backward's TTIR (``m`` rows of 262144: each traced afresh, as no other
        test traces them)."""
        config = pallas_config.heuristic(m, 262144, backward=True)
        offset = 1.0 if casting == "gemma" else 0.0
        with abstract_h100():
            lowered = launch_route._lower_backward(m, 262144, dtype, dtype, offset, casting, config, fused)
        ttir = launch_route.parse_program(lowered.compiler_ir("stablehlo")).calls[0].ttir
        return tuple(len(re.findall(pattern, ttir)) for pattern in (r"fma\.rn\.f32", r"cvt\.rn\.bf16x2", r"shl\.b32"))

    llama, gemma = ptx(128, "llama", False), ptx(128, "gemma", False)
    assert llama[0] == gemma[0] >= 2 and ptx(128, "llama", True)[0] >= 2  # (the fused add's walk: one loop here)
    assert llama[1] > 0 and gemma[1] == 0 and llama[2] > 0 and gemma[2] > 0
    assert ptx(128, "llama", False, torch.float16) == (0, 0, 0)
    assert ptx(128, "none", False)[0] == llama[0]  # r(rstd) on a (rows, 1) column: plain (it has no pairs)
    with monkeypatch.context() as patched:
        patched.setattr(backend, "_pairs", lambda t: True)
        with pytest.raises(Exception, match="multiple of the op's packed_element"):
            ptx(64, "none", False)
    monkeypatch.setattr(backend, "row_ops", lambda dt, interpret: backend.RowOps(
        lambda t: t.astype(jnp.float32), rounder(dt), lambda a, b, c: a * b + c, False))
    assert ptx(16, "llama", False) == (0, 0, 0)


def test_fused_add_backward_with_g_in_the_row_dtype_reads_first_unhinted(monkeypatch):
    """The band backward's first read of x and dy carries L2's ``evict_last`` (the band is read again two blocks
    later) but not in the fused add's with g in the row dtype (bf16 Llama) up to ``ADD_BWD_UNHINTED_MAX_COLS`` columns
    (H200 +0-6.8% there): no ``evict_last`` left in its TTIR; rms_norm's, Gemma's and longer rows' keep it. Broken
    variant: the limit at 0, the hint back."""
    from pallas_norm import backend
    from torch_bridge import launch_route

    monkeypatch.setattr(backend, "num_sms", lambda: 132)
    monkeypatch.setattr(backend, "gpu_model", lambda: "")

    def hinted(m: int, n: int, casting: str, fused: bool) -> int:
        """``evict_last`` loads in the lowered backward (bf16 rows, the heuristic's band config)."""
        config = pallas_config.heuristic(m, n, backward=True, fused=fused)
        assert config.lag
        offset = 1.0 if casting == "gemma" else 0.0
        with abstract_h100():
            lowered = launch_route._lower_backward(m, n, torch.bfloat16, torch.bfloat16, offset, casting, config, fused)
        return launch_route.parse_program(lowered.compiler_ir("stablehlo")).calls[0].ttir.count("evict_last")

    assert hinted(64, 32768, "llama", True) == 0
    assert min(hinted(64, 32768, "llama", False), hinted(64, 32768, "gemma", True),
               hinted(16, 131072, "llama", True)) > 0
    monkeypatch.setattr(band_tables, "ADD_BWD_UNHINTED_MAX_COLS", 0)
    assert hinted(96, 32768, "llama", True) > 0  # (rows not lowered above: the lowering is cached by shape)
