"""On an H200 (``backend.gpu_model() == "h200"``), where the forward's heuristic takes jaxlib's Triton call and on
which tiles, on CPU: the per-model tables (``ffi_tables.FWD_FFI_ALL_ROWS``, ``FWD_FFI_EXACT_BY_MODEL``,
``FWD_FFI_RESIDENT_BY_MODEL``, ``FWD_FFI_TWO_PASS_BY_MODEL``, ``FWD_FFI_TWO_PASS_PLAIN_BY_MODEL``,
``FWD_FFI_XLA_TILE_BY_MODEL``) against the H100's rules, each with its broken variant. The rest of the launch choice:
``test_ffi_choice.py``."""

from __future__ import annotations

import dataclasses

from pallas_norm import backend, pallas_config, triton_ffi
from pallas_norm.pallas_config import Config


def forward_tiles(shapes) -> dict:
    """The heuristic's forward config per key ``(m, n, fused, product_in_dtype[, itemsize])`` (itemsize 2 if absent)."""
    return {k: pallas_config.heuristic(k[0], k[1], backward=False, fused=k[2], product_in_dtype=k[3],
                                       itemsize=k[4] if len(k) > 4 else 2) for k in shapes}


def test_h200_launches_the_forward_of_rows_to_2048_columns_by_jaxlib_at_every_row_count(monkeypatch):
    """``FWD_FFI_ALL_ROWS``: on an H200 the resident forward of rows padded to 128-2048 columns (full or not: 700 and
    1000 pad to 1024) takes jaxlib's launch on the tiles XLA launches otherwise, at any row count, the plain forward
    and the fused add's alike; other lengths (64, 3840; 4096: the next test), other models (the H100's table: few
    full rows of 1024 only) and no ``available()`` keep XLA's launch."""
    monkeypatch.setattr(backend, "num_sms", lambda: 132)
    monkeypatch.setattr(triton_ffi, "available", lambda: True)
    shapes = [(m, n, f) for m in (64, 4096, 32768) for n in (64, 128, 256, 512, 700, 1000, 2048, 3840)
              for f in (False, True)]
    h100 = {s: pallas_config.heuristic(s[0], s[1], backward=False, fused=s[2]) for s in shapes}
    assert not h100[(32768, 512, False)].ffi_launch and not h100[(32768, 1000, True)].ffi_launch
    monkeypatch.setattr(backend, "gpu_model", lambda: "h200")
    for (m, n, fused), config in h100.items():
        h200 = pallas_config.heuristic(m, n, backward=False, fused=fused)
        expected = config.ffi_launch or 128 <= n <= 2048
        assert h200 == dataclasses.replace(config, ffi_launch=expected), (m, n, fused)
    monkeypatch.setattr(triton_ffi, "available", lambda: False)
    assert not pallas_config.heuristic(32768, 512, backward=False).ffi_launch


def test_h200_launches_the_forward_of_rows_of_exactly_3584_and_4096_by_jaxlib_on_their_tiles(monkeypatch):
    """``FWD_FFI_EXACT_BY_MODEL``: on an H200 the forward of rows of exactly 4096 columns (plain and fused add alike,
    Llama's and Gemma's products, any row count) runs a row per 8-warp program launched by jaxlib, where the H100 runs
    2 rows (the fused add 1) on 16 warps launched by XLA; of exactly 3584 two rows per 8-warp program, but where
    ``FWD_ONE_WARP`` takes Llama's many rows; 2304, which pads to 4096 too, keeps its tile (its launch: the last
    test). The broken variant: an empty table gives the H200's tiles without it; nothing changes without
    ``available()``."""
    monkeypatch.setattr(backend, "num_sms", lambda: 132)
    monkeypatch.setattr(triton_ffi, "available", lambda: True)
    shapes = [(m, n, f, p) for m in (64, 4096, 32768) for n in (2304, 3584, 4096) for f in (False, True)
              for p in (False, True)]

    h100 = forward_tiles(shapes)
    h100_4096 = {(c.block_rows, c.num_warps, c.ffi_launch) for s, c in h100.items() if s[1] == 4096}
    assert h100_4096 == {(2, 16, False), (1, 16, False)}  # the fused add's tile holds a row
    monkeypatch.setattr(backend, "gpu_model", lambda: "h200")
    h200 = forward_tiles(shapes)
    with monkeypatch.context() as broken:
        broken.setattr(pallas_config, "FWD_FFI_EXACT_BY_MODEL", {})
        without = forward_tiles(shapes)
    assert without[32768, 4096, False, True] == h100[32768, 4096, False, True]
    for (m, n, fused, product), config in h200.items():
        one_warp = pallas_config.one_warp_forward(m, n, 2, product)
        assert one_warp == (n == 3584 and product and m == 32768)
        tile = {3584: (2, 8), 4096: (1, 8)}.get(n) if not one_warp else None
        expected = without[m, n, fused, product]
        if tile:
            expected = dataclasses.replace(expected, block_rows=tile[0], num_warps=tile[1], ffi_launch=True)
        assert config == expected, (m, n, fused, product)
    monkeypatch.setattr(triton_ffi, "available", lambda: False)
    assert pallas_config.heuristic(32768, 4096, backward=False) == h100[32768, 4096, False, True]


def test_h200_holds_rows_of_8192_on_8_warps_and_16384_on_16(monkeypatch):
    """``FWD_FFI_RESIDENT_BY_MODEL``: on an H200 the jaxlib-launched forward of full rows padded to 8192 runs 8 warps
    (the H100's table 16) and of 16384 16 (32), the plain forward and the fused add's alike (a row's sum is reduced in
    an order set by the warps); 32768 keeps the H100's tile (the fused add's; the plain forward's two passes: the
    next test)."""
    monkeypatch.setattr(triton_ffi, "available", lambda: True)
    shapes = [(m, n, f) for m in (4096, 32768) for n in (7000, 8192, 16384, 32768) for f in (False, True)]
    h100 = {s: pallas_config.heuristic(s[0], s[1], backward=False, fused=s[2]) for s in shapes}
    assert {c.num_warps for (_, n, _), c in h100.items() if n <= 8192} == {16}
    assert {c.num_warps for (_, n, _), c in h100.items() if n == 16384} == {32}
    monkeypatch.setattr(backend, "gpu_model", lambda: "h200")
    for (m, n, fused), config in h100.items():
        if n == 32768 and not fused:
            continue
        h200 = pallas_config.heuristic(m, n, backward=False, fused=fused)
        warps = {8192: 8, 16384: 16}.get(pallas_config.next_pow2(n), config.num_warps)
        assert h200 == dataclasses.replace(config, num_warps=warps), (m, n, fused)
        assert h200.ffi_launch


def test_h200_forward_of_5120_and_the_plain_forward_of_32768(monkeypatch):
    """On an H200 (``ffi_tables.FWD_FFI_TWO_PASS_BY_MODEL``, ``FWD_FFI_EXACT_BY_MODEL``): 16-bit rows of 5120 leave
    the two passes for the resident (1, 8) launched by jaxlib (Llama's product; Gemma's float32 product from 96 rows
    per SM), Gemma's fewer rows take two passes of (4096, 8); float32 rows of 5120 take the resident (1, 8) too. The
    plain forward of 16-bit rows of 32768 runs two passes of (8192, 32) ((16384, 32) with Gemma's float32 product;
    ``FWD_FFI_TWO_PASS_PLAIN_BY_MODEL``), and
    with Gemma's float32 product those of 8192 and 16384 two passes of (4096, 16) and (8192, 16); the fused add's
    keeps its resident tile, as Llama's product at 8192 and 16384 and float32 rows. The Triton reference reads the
    same entries (its resident 5120 with N constant, ``triton_config.FWD_RESIDENT_BY_MODEL``).
    The broken variant: with the per-model two-pass tables emptied, the H200 runs the H100's two passes at 5120 and
    one tile for both forwards at 8192-32768."""
    from pallas_norm import ffi_tables
    from torch_bridge import triton_config

    monkeypatch.setattr(backend, "num_sms", lambda: 132)
    monkeypatch.setattr(triton_ffi, "available", lambda: True)
    shapes = [(m, n, f, p, s) for m in (4096, 32768) for n in (5120, 8192, 16384, 32768) for f in (False, True)
              for p in (False, True) for s in (2, 4)]

    h100 = forward_tiles(shapes)
    monkeypatch.setattr(backend, "gpu_model", lambda: "h200")
    h200 = forward_tiles(shapes)
    for (m, n, fused, product, size), config in h200.items():
        got = (config.block_rows, config.block_cols, config.num_warps, config.ffi_launch, config.l1_hints)
        if n == 5120:
            resident = size == 4 or product or m == 32768
            assert got == ((1, 8192, 8, True, True) if resident else (1, 4096, 8, True, True)), (m, n, fused, product)
            assert config.programs == (None if resident else m)
        elif n == 32768 and size == 2 and not fused:
            assert got == (1, 8192 if product else 16384, 32, True, True) and config.programs == m
        elif n == 32768:
            assert config == h100[m, n, fused, product, size] == Config(1, 32768, 16, ffi_launch=True, l1_hints=True)
        elif size == 2 and not fused and not product:
            assert got == (1, n // 2, 16, True, True) and config.programs == m, (m, n)
        else:
            assert config.resident(n) and config.programs is None, (m, n, fused, product, size)
    with monkeypatch.context() as broken:
        broken.setattr(ffi_tables, "FWD_FFI_TWO_PASS_BY_MODEL", {})
        broken.setattr(ffi_tables, "FWD_FFI_TWO_PASS_PLAIN_BY_MODEL", {})
        without = forward_tiles(shapes)
    key = (32768, 5120, False, True, 2)
    assert without[key] == h100[key] != h200[key]
    for n in (8192, 16384, 32768):  # one tile
        assert without[4096, n, False, False, 2] == without[4096, n, True, False, 2] != h200[4096, n, False, False, 2]
    assert h200[4096, 8192, False, True, 2] == h200[4096, 8192, True, True, 2]  # Llama's product: one tile
    forward = triton_config.forward_config
    assert forward(5120, 132, 2, True, 32768, False, "h200") == triton_config.Config(1, 8192, 8, l1_hints=True,
                                                                                   n_const=True)
    assert forward(5120, 132, 2, False, 4096, False, "h200") == triton_config.Config(1, 4096, 8, l1_hints=True)
    assert forward(32768, 132, 2, True, 8192, False, "h200") == triton_config.Config(1, 8192, 32, l1_hints=True)
    assert forward(32768, 132, 2, False, 8192, False, "h200") == triton_config.Config(1, 16384, 32, l1_hints=True)
    assert forward(16384, 132, 2, False, 8192, False, "h200") == triton_config.Config(1, 8192, 16, l1_hints=True)
    assert forward(32768, 132, 2, True, 8192, True, "h200") == forward(32768, 132, 2, True, 8192, True)
    assert not forward(32768, 132, 2, True, 8192, True, "h200").chunked(32768)


def test_h200_launches_the_forward_of_2304_to_12288_by_jaxlib_on_xla_s_tile_per_product(monkeypatch):
    """``FWD_FFI_XLA_TILE_BY_MODEL``: on an H200 the forward of 16-bit rows of 2304, 2560, 3072, 4608, 5376, 6144 and
    12288 columns (plain and fused add alike) keeps the heuristic's tile and takes jaxlib's launch from the table's
    rows per SM for its product: Llama's from 96 rows per SM at 2304 and at every row count at the others; Gemma's
    float32 product from 128 rows per SM at 2304/2560, 64 at 3072, every row count at 5376/6144, never at 4608
    (Mosaic GPU's there, ``auto.MOSAIC_FWD_F32_BY_MODEL``) or 12288. Float32 rows, 3840 and the H100 keep XLA's
    launch. Broken variant: the table emptied launches none by jaxlib."""
    monkeypatch.setattr(backend, "num_sms", lambda: 132)
    monkeypatch.setattr(triton_ffi, "available", lambda: True)
    widths = (2304, 2560, 3072, 3840, 4608, 5376, 6144, 12288)
    shapes = [(m, n, f, p, s) for m in (4096, 8192, 16384, 32768) for n in widths for f in (False, True)
              for p in (False, True) for s in (2, 4)]
    h100 = forward_tiles(shapes)
    assert not any(c.ffi_launch for c in h100.values())
    monkeypatch.setattr(backend, "gpu_model", lambda: "h200")
    h200 = forward_tiles(shapes)
    least = {2304: (96, 128), 2560: (0, 128), 3072: (0, 64), 4608: (0, None), 5376: (0, 0), 6144: (0, 0),
             12288: (0, None)}
    for (m, n, fused, product, size), config in h200.items():
        bound = least.get(n, (None, None))[0 if product else 1] if size == 2 else None
        expected = bound is not None and m >= bound * 132
        assert config == dataclasses.replace(h100[m, n, fused, product, size], ffi_launch=expected), (m, n, product)
    assert h200[16384, 2304, False, True, 2].ffi_launch and not h200[8192, 2304, False, True, 2].ffi_launch
    assert h200[4096, 5376, True, False, 2] == h200[4096, 5376, False, False, 2]  # one tile for both forwards
    assert h200[4096, 12288, False, True, 2].ffi_launch and not h200[4096, 12288, False, False, 2].ffi_launch
    monkeypatch.setattr(pallas_config, "FWD_FFI_XLA_TILE_BY_MODEL", {})
    assert forward_tiles(shapes) == h100
