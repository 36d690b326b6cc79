"""The Pallas kernels' resident and chunked tiles by row length (forward, the fused add's forward, the backward, rows
held as pieces), with the H100 measurements behind them (the H200's where a table names that model).
``pallas_config.heuristic`` reads them and re-exports them (``pallas_config.BWD_RESIDENT`` is this module's);
``ffi_tables`` and ``band_tables`` hold the jaxlib-launched and the column-band tables beside them.
"""

from __future__ import annotations

# The H100 sweep behind every number below: bench/results/sweep_h100_bfloat16_llama.md (kernels timed by CUDA
# events) unless named. Forward, resident rows off the FWD_RESIDENT table: TARGET_ELEMS elements per program, a warp
# per FWD_ELEMS_PER_WARP.
TARGET_ELEMS = 8192
FWD_ELEMS_PER_WARP = 1024
# Forward, resident rows filling more than PADDED_FILL of their padded length, by that length: (block_rows, warps),
# at any row count. H100, bf16, every (rows, warps) holding 8-64 elements per thread timed from JAX by its kernels'
# durations over rotated inputs, two rounds in one process (seventeenth session, `python -m bench.fwd_tiles`,
# bench/results/fwd_tiles_h100.md), TB/s against the previous rule (TARGET_ELEMS, FWD_ELEMS_PER_WARP, and (2, 4) /
# (2, 8) below 2048 programs): 32768×1024 (8, 8) 2.83 → 2.88, 32768×2048 (4, 8) 2.93 → 2.93, 4096×3584 (2, 8)
# 2.66 → 2.67, 4096×4096 2.69 → 2.72, 32768×3584 2.98 → 3.00, 32768×4096 2.98 → 3.00, 4096×16384 (1, 16) 2.82 →
# 2.83, 32768×16384 2.90 → 2.92; at 4096×1024, 4096×2048 and 8192 columns the tile was already the fastest.
# Eighteenth session, per-head widths (bench/results/fwd_tiles_heads_h100.md, 2^28 elements): 2048-element programs,
# where the rule gave 8192: 2^22×64 (32, 4) 2.98 → 2.99 (the fastest, (32, 8), 3.00), 2^21×128 (16, 4) 2.99 → 3.02,
# 2^20×256 (8, 4) 3.02 → 3.03 (torch.compile 3.02-3.03 in `bench fused`).
FWD_RESIDENT = {64: (32, 4), 128: (16, 4), 256: (8, 4),
                1024: (2, 4), 2048: (2, 8), 4096: (2, 16), 8192: (1, 8), 16384: (1, 32)}
# The fused add's forward (x and residual in, y and h out) likewise, from the same run: against the previous rule
# (the plain forward's), 4096×1024 (2, 4) 2.47 → 2.66 TB/s (its bytes, 4·M·N·2), 32768×1024 (8, 8) 2.89 → 2.94,
# 4096×2048 2.72 → 2.76, 32768×2048 2.95 → 2.99, 4096×4096 (2, 8) 2.81 → 2.87, 32768×4096 2.94 → 2.99, 4096×8192
# (1, 8) 2.91 → 2.93, 32768×8192 2.99 → 3.01, 4096×16384 (1, 16) 2.69 → 2.92, 32768×16384 2.80 → 2.97; the plain
# forward's new tiles would have cost it up to 8% (32 warps at 16384 columns). Nineteenth session: the fused add's
# y must be rms_norm(h)'s bits, and a row's sum is reduced in an order set by the warps (not the rows per program;
# H100, 8192 rows, probes_h100_2026-11-26_nineteenth.md): at 1024 and 8192 columns the fused forward now runs the
# plain forward's warps, its fastest such tile of the same run: 1024 (2, 1) → (4, 4), 4096×1024 2.66 → 2.66,
# 32768×1024 2.94 → 2.91; 8192 (1, 16) → (1, 8), 4096×8192 2.93 → 2.91, 32768×8192 3.01 → 2.99. At 8192 and 16384
# both forwards share FWD_FFI_RESIDENT's tile where jaxlib launches them; where it does not (no triton package), the
# fused forward keeps 8 warps against the plain's 32 (the plain's tile would cost it 8%, the reverse the plain 3%),
# and its y agrees with rms_norm(h) to the accuracy rule only (docs/jax.md says so).
FWD_ADD_RESIDENT = {1024: (4, 4), 2048: (1, 8), 4096: (1, 16), 8192: (1, 8), 16384: (1, 8)}
# Forward (plain and fused add: the same warps, so the fused add's y and rstd stay rms_norm(h)'s bits), rows of these
# exact widths on the GPU model named, from this many rows per SM: one row per one-warp program (its row sum in
# shuffles, no shared memory, so XLA's launch leaves it the driver's carveout; offline for sm_90 168 registers, 12
# programs per SM). Forty-third session (H200, bf16 llama, impl=None from JAX and torch's launch route, alternating
# processes, two rounds; bench/results/probes_h200_2026-11-28_fortythird.md §3), today's tile ((2, 16), the fused
# add (1, 16)) → one warp, plain / fused add TB/s: from JAX 32768×3584 3.94 / 4.19 → 4.21 / 4.28, 16384×3584 3.87 /
# 4.16 → 4.08 / 4.22; by torch 32768×3584 3.93 / 4.32 → 4.21 / 4.28, 16384×3584 3.85 / 4.28 → 4.08 / 4.21. Below
# the bound (between 62 and 124 rows per SM, untimed in between): 8192×3584 JAX 3.74 / 4.07 → 3.85 / 4.09, torch 3.70
# / 4.21 → 3.86 / 4.10; 4096×3584 JAX 3.50 / 3.92 → 3.43 / 3.89. Not taken: 2304 (from JAX +2.4% / +3% at 32768
# rows, but torch's plain −1.6%: its launch already runs XLA's binary at the driver's carveout) and 4096 (the fused
# add −4% from JAX, −7% by torch). Forty-fifth session (probes_h200_2026-11-28_fortyfifth.md §3): Gemma's casting
# (the weight's product in float32) loses with one warp, one-warp → today's tile, plain / fused add TB/s: from JAX
# 32768×3584 3.72 / 4.25 → 3.97 / 4.10, 16384×3584 3.59 / 4.18 → 3.91 / 4.07; by torch 32768×3584 3.72 / 4.26 →
# 4.23 / 4.31, 16384×3584 3.60 / 4.19 → 4.12 / 4.26. So the table holds for the product in the row's dtype only.
FWD_ONE_WARP = {"h200": {3584: 96}}
# Forward, resident rows filling at most PADDED_FILL of their padded length (2304 of 4096, 1536 or 3072 of
# 2048/4096): half the rows per program (TARGET_ELEMS counts padded elements, a quarter or more of which are masked
# off), the warps following. H100, bf16, kernels timed from JAX (2026-11-25, twelfth session,
# bench/results/fwd_padded_rows_h100.md): 32768×2304 1 row, 4 warps 2.96 TB/s against 2.85 for 2 rows, 8 warps;
# 4096×2304 2.53 against 2.40; 32768×1536 2 rows, 4 warps 2.93 against 2.89; 32768×3072 2.98 against 2.96,
# 4096×3072 2.61 against 2.60.
PADDED_FILL = 0.75
# Forward, long rows: chunk width, warps, programs per SM, prefetch (8192×32768: 2.76 TB/s, 4096×65536: 2.45,
# where the previous 4096-column chunks, 4 warps and a program per row gave 1.96 and 1.94).
FWD_CHUNKED = (16384, 32, 2, True)
# Backward, resident rows, by padded row length (at most the key): (elements per program, warps, programs per SM,
# prefetch, reload_weight). Loading the next rows while the current ones reduce pays from 512 to 8192 columns,
# best with 8192 elements over 16 warps and one program per SM (2026-11-24 sweep, bench/results/
# sweep_h100_bwd_2026-11-24.md: 32768×4096 2.71 TB/s against 2.58 for 4096 elements, 8 warps, 2 per SM; 32768×1024
# 1.91 against 1.79; 32768×3584 2.62 against 2.49; the fused add's backward, which also reads dh_out, 2.82 against
# 2.12 at 32768×4096). At 16384 every variant spilled, least with the weight out of registers (32768×16384: 2.45
# against 1.66); with dweight's term added before the row's sum too it does not (ffi_tables.BWD_FFI_HELD).
# Fourteenth session: the dweight reduction's cost had kept the grid at one program per SM. With it at 1.4-3.4 µs
# for 132-528 partial rows (dweight.REDUCE_ROWS), more and smaller programs pay at 512-2048 columns. From JAX (the
# kernels' durations, XLA's launch; H100, bf16, bench/results/sweep_h100_bwd_jax_2026-11-26.md; plain / fused add
# TB/s), the previous choice (8192 elements, 16 warps, 1 per SM) → these: 4096×1024 1.62 / 1.85 → 1.90 / 2.06,
# 32768×1024 2.17 / 2.52 → 2.74 / 2.83; 4096×2048 2.10 / 2.21 → 2.31 / 2.44, 32768×2048 2.65 / 2.67 → 2.88 / 2.94;
# 32768×512 2.03 / 2.21 → 2.30 / 2.55. At 4096 columns two programs per SM of one row help the plain backward
# (32768×4096 2.87 → 2.94) and cost the fused one more (2.95 → 2.80); both must share a grid (the fused add's dweight
# is rms_norm's bits), so 4096 keeps its choice. Eighteenth session, short rows (per-head q/k norms; the table was
# 16384 elements on 16 warps, one program per SM up to 256 columns), from JAX the same way, plain / fused add TB/s
# (bench/results/bwd_heads_h100.md, `python -m bench.bwd_candidates ... --jax --heads`): the plain backward is
# fastest in 4096-element programs on 4 warps, 4 per SM (2^20×128 2.59 → 2.83, 2^19×256 2.52 → 2.85), but the fused
# add's collapses there from 128 columns (2.70 → 2.38, 2.74 → 2.24). Tiles that gain both: at 64 columns the small
# programs (2^21×64 2.58 / 2.76 → 2.86 / 2.91); at 128 8192 elements on 8 warps, 2 per SM (2^20×128 2.59 / 2.70 →
# 2.74 / 2.83, 2^18×128 2.43 / 2.58 → 2.60 / 2.70); at 256 512's tile (2^19×256 2.52 / 2.74 → 2.75 / 2.82, 2^16×256
# 2.25 / 2.49 → 2.41 / 2.54), which 512 keeps (2.65 / 2.88; 4096 elements on 4 warps, 4 per SM 2.39 / 2.40).
# Twenty-fifth session: the grid is then trimmed to the fewest programs that keep the most row blocks per program
# (``balanced``: 4096×4096 on 128 programs of 16 blocks, not 132 of 15-16), so the last round runs on every SM it
# started on. H100, bf16, from JAX (probes_h100_2026-11-27_twentyfifth.md §5), plain / fused add TB/s: 4096×1024
# 2.02 / 2.25 → 2.04 / 2.25, 4096×2048 2.37 / 2.52 → 2.38 / 2.54, 4096×3584 2.54 → 2.55, 4096×4096 2.62 / 2.77 →
# 2.64 / 2.79, 4096×8192 2.75 → 2.79. The pieces (BWD_PIECES) keep their grid (4096×2304 lost 0.6%).
# Fortieth session: 64 and 128 columns take 256's tile unprefetched (ffi_tables.BWD_FFI_RESIDENT); narrower keep 64's.
BWD_RESIDENT = {**dict.fromkeys((1, 2, 4, 8, 16, 32), (4096, 4, 4, False, False)),
                **dict.fromkeys((64, 128), (4096, 8, 2, False, False)),
                **dict.fromkeys((256, 512), (4096, 8, 2, True, False)), 1024: (2048, 4, 4, True, False),
                2048: (4096, 8, 2, True, False),
                **dict.fromkeys((4096, 8192), (8192, 16, 1, True, False)),
                16384: (16384, 16, 1, False, True)}
# Backward, rows of these widths held as their power-of-two pieces (``Config.pieces``: 2304 = 2048 + 256, no masked
# lanes) in programs of one row: (warps, programs per SM, prefetch). Twenty-first session (H100, bf16, from JAX, the
# kernels' durations, `python -m bench.bwd_candidates ... --jax --pieces`, bench/results/bwd_pieces_h100.md; plain /
# fused add TB/s against the padded tile of BWD_RESIDENT): 32768×2304 2.46 / 2.69 → 2.72 / 2.85 (Mosaic GPU 2.64 /
# 2.83), 4096×2304 2.09 / 2.32 → 2.11 / 2.33; 32768×2560 2.55 / 2.72 → 2.63 / 2.82; 32768×5120 2.59 / 2.61 → 2.76 /
# 2.80, 4096×5120 2.33 / 2.37 → 2.38 / 2.51. Each width wants its own tile (one serves the plain and the fused add's
# backward: the fused add's dweight is rms_norm's bits; prefetching spills the fused one at 5120, 1.89). Halves of
# a power of two (1536, 3072, 6144) lose to their padded tile: not taken.
BWD_PIECES = {2304: (4, 4, False), 2560: (8, 2, True), 5120: (4, 2, False)}
# Backward inputs of at most this many elements run as one program (per column chunk) that stores dweight itself:
# one launch instead of the partials and their reduction (such calls are host-bound; the GPU time is a few µs).
ONE_PROGRAM_ELEMS = 1 << 16
# Backward, long rows: chunk width, warps, programs per SM (shared among a row's column chunks), prefetch. Every
# variant sits at ~59% of copy: the row-sum pass and the dx pass each read x and dy (5 passes for 3).
BWD_CHUNKED = (4096, 16, 2, False)
