"""Which kernels jaxlib's Triton call launches (``Config.ffi_launch``, ``triton_ffi``) instead of XLA, and on which
tiles: the tables, with the H100 measurements behind them (and ``two_pass_tile``, the two-pass table's lookup).
``pallas_config.heuristic`` reads them (and re-exports them: ``pallas_config.FWD_FFI_RESIDENT`` is this module's);
``ffi_forward``, ``ffi_xla_tile`` and ``ffi_backward`` there say where they apply (full rows, row counts,
``triton_ffi.available()``).

Why a second launcher pays: XLA launches every kernel with dynamic shared memory at the most shared memory, the
least L1 (``bench carveout``); jaxlib's Triton call keeps the driver's carveout.
"""

from __future__ import annotations

# The forward (plain and fused add: one tile, so the fused add's y is rms_norm(h)'s bits) of full rows of these
# padded lengths, launched by jaxlib's Triton call where ``triton_ffi`` is available (``Config.ffi_launch``: the
# driver's L1 carveout, not XLA's most-shared-memory one): (block_rows, warps). H100, bf16, kernels timed from JAX
# (bench/results/ffi_launch_h100.md): 32768×16384 2.99 TB/s on 16 warps (32, XLA's tile, 2.47 this way, 2.92 by
# XLA); 4096×16384 2.89 (XLA 2.82); rows of 32768 held whole 2.99 at 8192×32768 (XLA's launch 2.45, the bands 2.68,
# Mosaic GPU 2.74); 32768×8192 3.02 (XLA, 8 warps, 2.97), 4096×8192 2.84 (2.81); shorter rows lose 1-10% this way
# (probes_h100_2026-11-26_twentieth.md). The fused add's forward (4·M·N·2 bytes; the nineteenth and twentieth
# probes): 4096×16384 2.93 → 2.97, 8192×32768 2.74 → 3.01, 4096×8192 2.94 → 2.95. Thirty-first session, with the
# L1 hints (l1_hints.py; probes_h100_2026-11-27_thirtyfirst.md §4): 16384 on 32 warps (torch.compile's choice there),
# plain / fused add, bf16 llama and gemma alike, 32768×16384 3.049 / 3.033 → 3.051 / 3.054, 4096×16384 2.960 / 2.996 →
# 2.967 / 3.005 (8192 on 32 warps lost 5% in the thirtieth session's §2).
FWD_FFI_RESIDENT = {8192: (1, 16), 16384: (1, 32), 32768: (1, 16)}
# FWD_FFI_RESIDENT's tiles on the GPU model named, where they differ. Forty-third session (H200, bf16 llama, from JAX,
# kernels timed, two rounds; bench/results/probes_h200_2026-11-28_fortythird.md §4), plain / fused add TB/s, (1, 16)
# → (1, 8): 32768×8192 4.21 / 4.34 → 4.31 / 4.29 (torch.compile 4.29-4.31 in the suite runs), 4096×8192 3.92 /
# 4.17 → 4.01 / 4.15; (1, 4) 4.30 / 4.29 and 3.97 / 4.11; (1, 32) 3.35 / 4.34 and 3.21 / 4.18; (2, 16) 4.29 / 4.20
# and 3.93 / 4.00. Forty-fifth session (same method, probes_h200_2026-11-28_fortyfifth.md §4), 16384 on (1, 32) →
# (1, 16): bf16 llama 32768×16384 4.27 / 4.20 → 4.30 / 4.28, 4096×16384 4.09 / 4.09 → 4.11 / 4.18; gemma
# 32768×16384 4.12 / 4.17 → 4.15 / 4.28, 4096×16384 3.92 / 4.06 → 3.94 / 4.18; (1, 8) 3.59-3.85 plain, (2, 32)
# 3.61-3.79 plain.
FWD_FFI_RESIDENT_BY_MODEL = {"h200": {8192: (1, 8), 16384: (1, 16)}}
# Per GPU model: the resident forward (plain and fused add) of rows of exactly these lengths, launched by jaxlib on
# these tiles (block_rows, warps) where FWD_ONE_WARP does not take it (FWD_FFI_RESIDENT holds padded lengths; 2304 pads
# to 4096 too and is not here). Forty-sixth session (H200, from JAX and by torch, kernels timed over rotated inputs, two
# rounds, the slower quoted; probes_h200_2026-11-29_fortysixth.md §2), XLA's launch of (2, 16) → jaxlib's of (1, 8),
# plain from JAX / fused add from JAX / plain by torch, TB/s: llama 32768×4096 4.10 / 4.20 / 4.26 → 4.28 / 4.28 / 4.27,
# 4096×4096 3.66 / 3.91 / 3.79 → 3.78 / 4.04 / 3.80; gemma 32768×4096 4.07 / 4.19 / 4.25 → 4.27 / 4.27 / 4.27,
# 16384×4096 4.01 / 4.15 / 4.18 → 4.18 / 4.25 / 4.17, 8192×4096 3.90 / 4.08 / 4.01 → 4.04 / 4.17 / 4.02, 4096×4096 3.57
# / 3.92 / 3.71 → 3.70 / 4.02 / 3.69, 2048×4096 3.23 / 3.67 / 3.17 → 3.15 / 3.77 / 3.17; fp16 llama 32768×4096 4.11 /
# 4.09 / 4.26 → 4.28 / 4.28 / 4.27, 4096×4096 3.65 / 3.89 / 3.79 → 3.80 / 4.05 / 3.79; float32 llama 32768×4096 4.10 /
# 4.19 / 4.29 → 4.28 / 4.26 / 4.28, 4096×4096 3.80 / 3.96 / 3.96 → 4.00 / 4.11 / 4.01. jaxlib's launch of (2, 16)
# (FWD_FFI_ALL_ROWS' way): gemma's plain from JAX as (1, 8), llama's level, by torch −0.1 to −4.6% (the triton package's
# binary of that tile; the torch route launches XLA's with the driver's carveout already). 3584 (§3), (2, 16) by XLA →
# (2, 8) by jaxlib: gemma 32768×3584 3.99 / 4.12 / 4.22 → 4.24 / 4.27 / 4.23, 4096×3584 3.41 / 3.83 / 3.55 → 3.55 / 3.98
# / 3.53; llama (below FWD_ONE_WARP's rows) 8192×3584 3.69 / 4.04 / 3.70 → 3.98 / 4.13 / 4.02, 4096×3584 3.39 / 3.88 /
# 3.41 → 3.64 / 3.95 / 3.65; on (1, 8) by torch 4.25 → 4.06 (gemma, 32768 rows), (1, 4) 4.20 / 4.28 / 4.20, (4, 8) 3.94
# / 4.27 / 3.93 (float32 rows of 3584 untimed). Not 2304 on its (1, 4) (§4): from JAX +2 to +5% from 16384 rows, −2.3%
# (gemma) at 4096; by torch 0 to −2.7%; the fused add +1.7 to +3.8%.
# Forty-seventh session: 5120 on (1, 8) where FWD_FFI_TWO_PASS_BY_MODEL leaves it resident (its note, below).
FWD_FFI_EXACT_BY_MODEL: dict[str, dict[int, tuple[int, int]]] = {"h200": {3584: (2, 8), 4096: (1, 8), 5120: (1, 8)}}
# The forward (plain and fused add: one tile, so the fused add's y is rms_norm(h)'s bits) of 16-bit rows of these
# widths in two passes over column chunks, one row per program, launched by jaxlib's Triton call, with L1 hints
# (``Config.l1_hints``: the first pass keeps the row in L1, the second reads it there; the design of torch.compile's
# looped reduction): (chunk columns, warps) where y's product is in the row dtype (llama), then where it is float32
# (gemma). Twenty-ninth session (H100, kernels timed from JAX, two rounds; probes_h100_2026-11-27_twentyninth.md §5),
# against the resident tile (8 warps, XLA's launch), plain / fused add TB/s: bf16 llama 32768×5120 3.00 / 2.99 → 3.04
# / 3.02 (torch.compile 3.03; without the hints 3.00, by XLA's launch 2.89), 8192×5120 2.92 / 2.96 → 2.94 / 2.99,
# 4096×5120 2.80 / 2.89 → 2.82 / 2.92; fp16 llama alike; bf16 gemma on 8 warps 32768×5120 2.97 / 2.98 → 3.01 / 2.98,
# 4096×5120 2.77 / 2.88 → 2.81 / 2.91 (on 16 warps 2.72 / 2.92). At 2304 and 3584 columns no two-pass tile beat
# the resident plain forward. The Triton reference's forward reads this table too (``triton_config.forward_config``,
# ``triton_two_pass``: the row length a compile-time constant; its run-time walk with the hints lost 3-10%, §9).
# Thirtieth session (H100, launched by torch; probes_h100_2026-11-27_thirtieth.md §1), plain / fused add against its
# resident tile: bf16 llama 32768×5120 3.02 / 3.01 → 3.04 / 3.02 (torch.compile 3.03), 4096×5120 2.79 / 2.90 → 2.81 /
# 2.93; bf16 gemma (8 warps) 32768×5120 3.01 / 3.00 → 3.01 / 2.96, 4096×5120 2.76 / 2.88 → 2.82 / 2.88.
# Thirty-first session (H100, from JAX, a 1 GB copy before every timing; probes_h100_2026-11-27_thirtyfirst.md §2):
# where y's product is float32 the tile follows the rows: from TWO_PASS_MANY_ROWS_PER_SM rows per SM 2048-column
# chunks on 16 warps, plain / fused add, bf16 gemma 32768×5120 3.00 / 2.97 → 3.03 / 3.02, 16384×5120 2.98 / 2.99 →
# 3.00 / 3.02; at 8192 rows (62 per SM) plain −0.4%, fused +0.6%; at 4096 plain −2%.
FWD_FFI_TWO_PASS = {5120: ((4096, 16), (4096, 8), (2048, 16))}
TWO_PASS_MANY_ROWS_PER_SM = 96
# FWD_FFI_TWO_PASS' entries on the GPU model named, where they differ (None: no two passes, the resident forward of
# FWD_FFI_EXACT_BY_MODEL's tile). Forty-seventh session (H200, kernels timed from JAX and by the torch route, two
# rounds, the slower quoted; `python -m bench.ffi_launch ... --tiles R:W[:C] --routes plain,fused,torch`,
# probes_h200_2026-11-29_fortyseventh.md §2), plain / fused add / plain by torch, TB/s: bf16 llama, (4096, 16) → the
# resident (1, 8) by jaxlib, 32768×5120 3.78 / 4.31 / 3.77 → 4.29 / 4.30 / 4.29, 4096×5120 3.46 / 4.09 / 3.43 → 3.92 /
# 4.09 / 3.90 (two passes of (4096, 8) 4.25 / 4.13 / 4.25 and 3.85 / 4.00 / 3.86); fp16 llama 32768×5120 3.85 / 4.30
# / 3.84 → 4.30 / 4.30 / 4.29, 4096×5120 3.54 / 4.09 / 3.52 → 3.92 / 4.09 / 3.92; bf16 gemma from
# TWO_PASS_MANY_ROWS_PER_SM rows per SM, (2048, 16) → the resident (1, 8), 32768×5120 3.70 / 4.31 / 3.69 → 4.26 / 4.30
# / 4.26 (two passes of (4096, 8) 4.26 / 4.25 / 4.26); below, (4096, 8) kept: 4096×5120 3.80 / 4.04 / 3.80 (the
# resident (1, 8) 3.73 / 4.09 / 3.70). Mosaic GPU 4.17-4.21 and 3.60-3.74 (plain from JAX). float32 rows (never two
# passes) on (1, 8), XLA's launch → jaxlib's: 32768×5120 4.01 / 4.11 / 4.27 → 4.29 / 4.26 / 4.28, 4096×5120 3.77 /
# 3.95 / 4.01 → 4.02 / 4.15 / 4.02.
FWD_FFI_TWO_PASS_BY_MODEL: dict[str, dict[int, tuple]] = {"h200": {5120: (None, (4096, 8), None)}}
# Per GPU model: the plain forward (not the fused add's, which keeps its resident tile and whose y is then within two
# ulps of rms_norm(h)'s, not its bits: docs/jax.md) of 16-bit rows of these lengths in two passes, (chunk columns,
# warps) for the weight's product in the row's dtype (Llama's casting), then in float32 (Gemma's); None: resident.
# Forty-seventh session (same method and file, §3), the resident (1, 16) by jaxlib → two passes of (8192, 32), plain /
# plain by torch, TB/s: bf16 llama 16384×32768 3.99 / 3.99 → 4.30 / 4.30, 8192×32768 3.96 / 3.96 → 4.26 / 4.26
# (torch.compile 4.18-4.19 in the suite), 4096×32768 3.90 / 3.89 → 4.18 / 4.17; gemma 8192×32768 3.73 / 3.73 → 4.24 /
# 4.24 (torch.compile 4.26-4.27), 4096×32768 3.67 / 3.67 → 4.15 / 4.14; (4096, 32) 0.3-0.9% below, (8192, 16) 3.94-4.01.
# The fused add on two passes of (8192, 32) 3.71-3.76 against 4.18-4.29 resident (its second pass re-reads x and the
# residual, 128 KB a row, past L1): it keeps its tile.
# Fiftieth session (same method; probes_h200_2026-11-29_fiftieth.md §4), Gemma's float32 product, the resident (1, 8)
# / (1, 16) by jaxlib → two passes, plain / plain by torch at 4096 / 32768 rows, TB/s: 8192 on (4096, 16) 3.94 /
# 4.28, 3.91 / 4.28 → 4.01 / 4.29, 3.95 / 4.29 (torch.compile's own kernel: two passes of 2048 on 16 warps, 4.03 at
# 4096 rows in the suite); 16384 on (8192, 16) 3.93 / 4.15, 3.94 / 4.15 → 4.07 / 4.29, 4.07 / 4.29. Not Llama's
# product: 8192 +0.5% / level, 16384 level / -0.3% (4096 / 32768 rows). Fifty-first session (same method;
# probes_h200_2026-11-29_fiftyfirst.md §5), Gemma's 32768 on (8192, 32) → (16384, 32), plain / by torch at 4096 / 8192
# / 16384 rows: 4.13 / 4.14, 4.23 / 4.23, 4.28 / 4.28 → 4.18 / 4.17, 4.24 / 4.25, 4.29 / 4.28 (torch.compile 4.26 at
# 8192 rows, `ties_h200_bfloat16_gemma.md`); the Triton reference level to +0.2%.
FWD_FFI_TWO_PASS_PLAIN_BY_MODEL: dict[str, dict[int, tuple]] = {"h200": {
    32768: ((8192, 32), (16384, 32)), 8192: (None, (4096, 16)), 16384: (None, (8192, 16))}}


def two_pass_tile(n: int, itemsize: int, product_in_dtype: bool, m: int = 0, sms: int = 132, *,
                  fused: bool = False, model: str = "") -> tuple[int, int] | None:
    """``FWD_FFI_TWO_PASS``' (chunk columns, warps) for the forward (plain or ``fused`` add) of ``m`` rows of ``n``
    ``itemsize``-byte elements (16-bit rows of its widths; ``product_in_dtype``: ``kernels.product_in_dtype``, else
    the float32 product's tile for few or, from ``TWO_PASS_MANY_ROWS_PER_SM`` per SM of ``sms``, many rows), on the
    GPU ``model`` (``backend.model_slug``) ``FWD_FFI_TWO_PASS_BY_MODEL``'s entry and for the plain forward
    ``FWD_FFI_TWO_PASS_PLAIN_BY_MODEL``'s for its product where they name one, or None; both stacks' heuristics read it
    (``pallas_config.two_pass_tile``; the Pallas kernels' where ``triton_ffi.available()``)."""
    if itemsize != 2:
        return None
    plain = None if fused else FWD_FFI_TWO_PASS_PLAIN_BY_MODEL.get(model, {}).get(n)
    if plain and (tile := plain[0 if product_in_dtype else 1]):
        return tile
    tiles = FWD_FFI_TWO_PASS_BY_MODEL.get(model, {}).get(n, FWD_FFI_TWO_PASS.get(n))
    if tiles is None:
        return None
    return tiles[0 if product_in_dtype else 2 if m >= TWO_PASS_MANY_ROWS_PER_SM * sms else 1]


# The resident backward (plain and fused add: one launch, so the fused add's dweight is rms_norm's bits) of full rows
# of these padded lengths (not held as pieces), launched by jaxlib's Triton call where ``triton_ffi`` is available, on
# BWD_RESIDENT's tile. Twenty-second session (H100, bf16, kernels timed from JAX, `python -m bench.bwd_candidates ...
# --jax --ffi`, probes_h100_2026-11-26_twentysecond.md §3), plain / fused add TB/s, XLA's launch → jaxlib's: 4096×2048
# 2.33 / 2.47 → 2.38 / 2.55, 32768×2048 2.88 / 2.93 → 2.86 / 3.00, 4096×3584 2.46 / 2.64 → 2.54 / 2.72, 32768×3584
# 2.80 / 2.92 → 2.91 / 3.01, 4096×4096 2.56 / 2.69 → 2.62 / 2.77, 32768×4096 2.87 / 2.94 → 2.91 / 3.03, 4096×8192
# 2.70 / 2.72 → 2.75 / 2.86, 32768×8192 2.89 / 2.89 → 2.93 / 3.03. Twenty-third session: with the assembler held to
# ``register_cap`` (probes_h100_2026-11-26_twentythird.md §2: with and without the cap in alternating processes, two
# rounds each), 1024 too: XLA's launch → jaxlib's, 32768×1024 2.77 / 2.85 → 2.80 / 2.90 (without the cap 2.72 /
# 2.90), 4096×1024 1.99 / 2.15 → 2.03 / 2.25 (1.97 / 2.24); 32768×2048's plain 2.85 → 2.90, the other widths ±0.5%.
# Fortieth session, per-head rows (probes_h100_2026-11-28_fortieth.md §2-4): 64 and 128 columns on 4096-element
# tiles of 8 warps, 2 per SM (BWD_RESIDENT), dweight's terms kept per tile row (kernels.DW_PER_ROW), launched by jaxlib
# from BWD_FFI_MIN_ROWS_PER_SM rows per SM. Plain / fused add TB/s, the old heuristic (64: 4096 elements on 4 warps,
# 4 per SM; 128: 8192 on 8, 2 per SM; XLA's launch) → the new: 4194304×64 2.85 / 2.93 → 2.87 / 3.00, 262144×64
# 2.52 / 2.69 → 2.63 / 2.75, 2097152×128 2.78 / 2.85 → 2.89 / 3.01, 131072×128 2.48 / 2.56 → 2.59 / 2.72. Fewer rows
# keep XLA's launch of the new tile: jaxlib's, XLA's → 32768×64 1.51 / 1.69, 1.55 / 1.70 (old 1.53 / 1.71);
# 16384×128 1.35 / 1.57, 1.52 / 1.71 (old 1.51 / 1.70); 32768×128 1.88 / 2.06, 1.95 / 2.13; 65536×64 2.01 / 2.17,
# 1.99 / 2.14; 65536×128 2.29 / 2.45, 2.27 / 2.44; 131072×64 2.37 / 2.52, 2.31 / 2.43 (the bound, 384 rows per SM,
# lies between 248 and 496; untimed in between). 256 columns keep XLA's launch (65536×256 plain 2.58 against 2.42).
# Forty-first session (probes_h100_2026-11-28_fortyfirst.md §2), at 300 and 450 rows per SM, jaxlib's launch against
# XLA's: 39600×64 1.61 / 1.83 against 1.61 / 1.71, 59400×64 1.93 / 2.12 against 1.89 / 1.97; 39600×128 1.99 / 2.16
# against 2.04 / 2.17, 59400×128 2.21 / 2.38 against 2.18 / 2.30: so 64's bound moves to 300, 128's stays. 512 with
# the per-row dweight (order_tables.DW_PER_ROW's note): jaxlib's launch from 384 rows per SM (65536 rows: 496).
BWD_FFI_RESIDENT = frozenset({64, 128, 512, 1024, 2048, 4096, 8192})
BWD_FFI_MIN_ROWS_PER_SM = {64: 300, 128: 384, 512: 384}
# The backward (plain and fused add) of 16-bit rows of exactly these lengths (not on a grid of one program): held whole
# on BWD_RESIDENT's tile (one program per SM on 16 warps, the weight loaded for every row block and dweight's term
# added before the row's sum: ``Config.reload_weight``) launched by jaxlib's Triton call, instead of column bands.
# Thirty-eighth session (H100, from JAX, kernels timed, two rounds; probes_h100_2026-11-27_thirtyeighth.md §2), TB/s,
# bands → this: bf16 llama 4096×16384 2.57 → 2.71-2.74, 32768×16384 2.64 → 2.89, gemma 2.67 → 2.72-2.74, 2.74 →
# 2.88, fp16 4096×16384 2.61 → 2.74-2.75; the fused add's (4·M·N·2 bytes) 2.58 → 2.80-2.81, 2.60 → 2.95, gemma 2.67 →
# 2.85. Spill-free (128 registers; the fused add's 48 B of local memory); XLA's launch reads 2.29-2.54, the tile
# holding the weight spills 64-144 B and reads 2.26-2.70. Mosaic GPU (``impl=None``'s) reads the same within 1%.
BWD_FFI_HELD = frozenset({16384})
# The forward (plain and fused add: both or neither, so the fused add's y and rstd are rms_norm(h)'s bits) of full
# rows of these padded lengths on their FWD_RESIDENT / FWD_ADD_RESIDENT tiles, launched by jaxlib's Triton call where
# the plain tile's grid fits the GPU at once: at most ``rows per SM × SMs`` rows (the value). Every program's loads
# are then in flight together, which XLA's carveout (the least L1) throttles. Twenty-fifth session (H100, from JAX,
# kernels timed over rotated inputs, two rounds; probes_h100_2026-11-27_twentyfifth.md §3-4), XLA's launch →
# jaxlib's, plain / fused add TB/s, 4096×1024: bf16 llama 2.40 / 2.30 → 2.41 / 2.44, gemma 2.34 / 2.67 → 2.38 /
# 2.72, fp16 2.40 / 2.31 → 2.43 / 2.44; 2048 rows level or better; beyond one wave the plain forward loses ~1%
# (8192×1024 2.60 → 2.57, 32768×1024 2.90 → 2.88). rstd's bits follow the compiler (the triton package sums a
# thread's elements in another order than XLA's Triton); y's did not change.
FWD_FFI_FEW_ROWS = {1024: 32}
# Per GPU model (``backend.gpu_model()``): the padded lengths whose resident forward (plain and fused add, both or
# neither; any fill) jaxlib's Triton call launches on those tiles at every row count. Forty-second session (H200, bf16
# llama, from JAX, kernels timed over rotated inputs, two rounds; probes_h200_2026-11-28_fortysecond.md §2-3), XLA's
# launch → jaxlib's, plain / fused add TB/s: 2097152×128 4.10 / 4.10 → 4.21 / 4.20, 1048576×256 4.13 / 4.10 → 4.23 /
# 4.21, 524288×512 3.98 / 4.05 → 4.15 / 4.12, 32768×1024 3.99 / 4.05 → 4.01 / 4.17, 4096×2048 3.31 / 3.76 → 3.36 /
# 3.77, 32768×2048 4.11 / 4.21 → 4.18 / 4.26. Not 4096 (2304, 3584, 4096 columns): there the plain forward from JAX
# is level (2304 +2.0/+2.6%, 3584 -0.7%) while the torch launch route, which launches XLA's binary with the driver's
# carveout otherwise, lost 4% in the suite (4096×4096 3.79 → 3.62, 32768×4096 4.27 → 4.11; the fused add from JAX
# gained 3%). The H100 keeps FWD_FFI_FEW_ROWS alone (its plain forward lost ~1% beyond one wave this way).
FWD_FFI_ALL_ROWS: dict[str, frozenset[int]] = {"h200": frozenset({128, 256, 512, 1024, 2048})}
# Per GPU model: 16-bit rows of these exact widths (padded to 4096 or 8192) whose resident forward (plain and fused add)
# jaxlib's Triton call launches on the heuristic's tile ((1, 4) / (1, 8)) from this many rows per SM: (the weight's
# product in the row's dtype (Llama's casting), in float32 (Gemma's)); None: never (Gemma's takes Mosaic GPU there:
# auto.MOSAIC_FWD_F32_BY_MODEL). Forty-eighth session (H200, bf16, from JAX and by torch's launch route, kernels timed
# over rotated inputs, two rounds, the slower quoted; probes_h200_2026-11-29_fortyeighth.md §2), XLA's launch →
# jaxlib's, plain / fused add / by torch TB/s, Llama: 32768×6144 4.07 / 4.07 / 4.29 → 4.30 / 4.30 / 4.30, 4096×6144 3.82
# / 3.91 / 3.96 → 3.95 / 4.14 / 3.95, 32768×5376 4.06 / 4.08 / 4.29 → 4.30 / 4.30 / 4.29, 32768×3072 4.09 / 4.10 / 4.22
# → 4.22 / 4.27 / 4.22, 4096×3072 3.54 / 3.81 / 3.66 → 3.65 / 3.96 / 3.63; Gemma: 32768×5376 3.95 / 4.08 / 4.26 → 4.26 /
# 4.28 / 4.25, 4096×5376 3.67 / 3.90 / 3.78 → 3.74 / 4.06 / 3.72, 32768×2304 3.98 / 4.14 / 4.20 → 4.19 / 4.26 / 4.19.
# The torch route launched XLA's binary at the driver's carveout already: level (within 1%) but at few rows of 2304 and
# Gemma's 2560 (8192×2304 Llama −1.6%, 4096×2560 Gemma −3.7%: the bounds). Not 3840: jaxlib's compile of its (2, 16)
# loses 1.6% from JAX and 6.7% by torch. Forty-ninth session (probes_h200_2026-11-29_fortyninth.md §6; fiftieth
# §1 for the bits), Llama's 12288 on the heuristic's (1, 16), XLA's launch → jaxlib's at 4096 / 32768 rows, TB/s:
# plain 3.72 / 3.88 → 4.10 / 4.32, fused add 3.96 / 4.03 → 4.23 / 4.31, by torch 3.87 / 4.10 → 4.11 / 4.32. Not
# Gemma's 12288: +2% plain and +7% fused add from JAX, but -1% by torch.
FWD_FFI_XLA_TILE_BY_MODEL: dict[str, dict[int, tuple[int | None, int | None]]] = {"h200": {
    2304: (96, 128), 2560: (0, 128), 3072: (0, 64), 4608: (0, None), 5376: (0, 0), 6144: (0, 0), 12288: (0, None)}}
# The pieces' backward (plain and fused add) at these widths, launched by jaxlib's Triton call where ``triton_ffi``
# is available, on these tiles instead of BWD_PIECES': (warps, programs per SM, prefetch), the Triton reference's
# (triton_config.BWD_PIECES), which XLA's launch collapses. H100, bf16, from JAX (`python -m bench.bwd_candidates ...
# --jax --pieces --ffi`, bench/results/bwd_pieces_ffi_h100.md), plain / fused add TB/s against Mosaic GPU (impl=None's
# until then): 32768×5120 2.86 / 2.88 against 2.74 / 2.87 (by XLA 1.98 / 2.41), 4096×5120 2.48 / 2.59 against 2.37 /
# 2.50. With ``register_cap`` (probes_h100_2026-11-26_twentythird.md §2; the sweep ran without it): 32768×2560 2.86 /
# 2.89 against Mosaic GPU's 2.69 / 2.86 (without the cap the fused add read 2.79), 4096×2560 2.26 / 2.39 against
# 2.19 / 2.34 (2.29); 32768×2304 2.81 / 2.84 against XLA's launch 2.70 / 2.85 (its fused add took 135 registers
# and read 2.19 without the cap), 4096×2304 2.17 / 2.32 against 2.11 / 2.32.
BWD_FFI_PIECES = {2304: (4, 4, False), 2560: (4, 4, False), 5120: (8, 2, False)}
# BWD_FFI_PIECES' entries on the GPU model named, where they differ: the fused add's tile (the plain backward's grid:
# BWD_FFI_PIECES_PLAIN_BY_MODEL takes its warps and prefetch). Fiftieth session (H200, bf16, from JAX, kernels timed
# over rotated inputs, two rounds; probes_h200_2026-11-29_fiftieth.md §3), the fused add's backward at 2304 on 2
# warps prefetching, TB/s at 4096 / 32768 rows: Llama 2.90 / 3.69 → 2.94 / 3.87, Gemma 2.96 / 3.77 → 3.07 / 3.89
# (4 warps prefetching: Llama 2.71 / 3.54, Gemma 2.99 / 4.03). 2560 keeps (4, 4, False): 2 warps prefetching lost
# 11-15% at 32768 rows.
BWD_FFI_PIECES_BY_MODEL = {"h200": {2304: (2, 4, True)}}
# rms_norm's backward (not the fused add's) of those rows: (warps, prefetch, most rows per program or None) on
# BWD_FFI_PIECES' grid, one row per program at a time, so dweight keeps the fused add's bits (dx's follow the warps).
# Twenty-fourth session (H100, bf16, from JAX; probes_h100_2026-11-26_twentyfourth.md §7): 5120 on 4 warps,
# prefetching, at 4096 / 8192 / 16384 / 32768 rows 2.47 → 2.59, 2.67 → 2.78, 2.78 → 2.87, 2.84 → 2.88 TB/s; 2304
# prefetching up to 32 rows per program 2.17 → 2.34, 2.48 → 2.60, 2.69 → 2.78 (at 62, 32768 rows: 2.81 → 2.73).
# The fused add's backward, with dh_out a third row in flight, loses 3-13% either way.
BWD_FFI_PIECES_PLAIN = {2304: (4, True, 32), 5120: (4, True, None)}
# BWD_FFI_PIECES_PLAIN's entries on the GPU model named, where they differ. Forty-fourth session (H200, bf16 llama,
# from JAX, kernels timed, two rounds in one process; bench/results/probes_h200_2026-11-28_fortyfourth.md §3): 2304
# and 2560 prefetching at every row count, plain TB/s on 4 warps, without → with: 32768×2304 3.53 → 3.98,
# 65536×2304 3.64 → 4.09 (8 warps 3.99, 4.12); 4096×2560 2.78 → 3.10, 8192×2560 3.22 → 3.56, 16384×2560 3.53 →
# 3.90, 32768×2560 3.71 → 4.09 (8 warps 2.82-3.82). At 4096-16384 rows of 2304 (up to 32 per program) both tables
# prefetch already (3.01, 3.45, 3.78; without 2.68, 3.08, 3.37). The fused add's backward keeps BWD_FFI_PIECES'
# tile: prefetching cost it 4-9%.
BWD_FFI_PIECES_PLAIN_BY_MODEL = {"h200": {2304: (4, True, None), 2560: (4, True, None)}}
