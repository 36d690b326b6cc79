"""The Triton reference's backward tiles by row length (resident rows, per-head rows, rows held whole at 16384,
N constant, rows held as pieces), with the measurements behind them. ``triton_config._backward_config`` reads them
and ``triton_config`` re-exports them (``triton_config.BWD_PIECES`` is this module's), as ``pallas_config`` does the
Pallas kernels' ``tile_tables``.
"""

from __future__ import annotations

# The resident backward loads its next row block before the current one's math for padded rows of BWD_PREFETCH_N
# (the Pallas kernels' design), one program per SM at 8192 columns. H100 bf16, CUDA events (twelfth session,
# bench/results/sweep_h100_bfloat16_llama_triton_bwd.md): 32768×1024 2.21 → 2.39 TB/s, 32768×2048 2.46 → 2.70,
# 32768×2304 2.03 → 2.36, 32768×3584 2.49 → 2.78, 32768×4096 2.64 → 2.83, 32768×5120 2.07 → 2.55, 32768×8192 2.55
# → 2.91, 4096×4096 1.90 → 2.07 (512 columns: the Pallas kernels' sweep, not re-swept here).
BWD_PREFETCH_N = (512, 8192)
# Padded rows of BWD_PREFETCH_N[0] to this many columns run one warp per 1024 tile elements instead of 512 (4 warps,
# the Pallas kernels' choice there). H100 bf16, kernels timed over rotated inputs (eighteenth session, `python -m
# bench.bwd_candidates ... --triton`, bench/results/triton_bwd_tiles_h100.md), plain / fused add TB/s: 4096×512
# 0.96 / 1.01 → 1.24 / 1.47, 32768×512 2.36 / 2.16 → 2.51 / 2.66, 4096×1024 1.65 / 1.90 → 1.93 / 2.14, 32768×1024
# 2.71 / 2.83 → 2.75 / 2.88, 65536×1024 2.84 / 2.94 → 2.86 / 2.96; at 2048 8 warps stay faster (4096×2048 2.34 / 2.45
# against 2.28 / 2.42).
BWD_FEW_WARPS_MAX_N = 1024
# The resident backward (plain and fused add: one tile, so the fused add's dweight stays rms_norm's bits) of padded
# per-head rows of these lengths: (warps, prefetch) on the TILE_ELEMS rows, 2 programs per SM, instead of one warp per
# 512 elements without prefetch. Thirty-ninth session (H100, bf16 llama, launched by torch, kernels timed over rotated
# inputs, three rounds alternating in one process; probes_h100_2026-11-28_thirtyninth.md §2-3), TB/s, plain / fused:
# 4194304×64 2.88 / 2.93 → 2.92 / 3.01, 262144×64 2.62 / 2.67 → 2.64 / 2.77, 16384×64 0.95 / 1.18 → 1.02 / 1.20;
# 2097152×128 2.89 / 2.94 → 2.93 / 3.01, 131072×128 2.57 / 2.64 → 2.61 / 2.72, 8192×128 0.82 / 1.03 → 0.92 / 1.04.
# At 256 that tile lost (1048576×256 2.72 against 2.93; prefetch and 4 warps each lose alone): 256 keeps (16, 8).
# 16-bit rows only (fp16 and gemma not timed; local ptxas: 192-231 registers, no spills, 2 programs per SM fit): with
# float32 rows the fused add's spills (255 registers, 16-48 B), so they keep 8 warps without prefetch.
BWD_HEADS = {64: (4, True), 128: (4, True)}
# rms_norm's backward of full rows of these padded lengths, where g = r(dy·w_eff) is one multiply in the row dtype
# (``low``, ``triton_product.grad_in_dtype``: 16-bit llama without offset and the weight in the row dtype, or none;
# w_eff then held as 16-bit values, half the registers): the row held whole, (rows per program, warps) on one program
# per SM, instead of column bands. Thirty-third session (H100, launched by torch, kernels timed, three rounds;
# probes_h100_2026-11-27_thirtythird.md §5), bf16 TB/s, bands → (1, 16): 32768×16384 2.53 → 2.86, 4096×16384 2.44
# → 2.72 (Liger 2.65, 2.39); without the 16-bit multiply the tile spills (128 registers) and reads 2.56 / 2.38.
# float16 (thirty-fourth session, probes_h100_2026-11-27_thirtyfourth.md §1): 32768×16384 2.58 → 2.76, 4096×16384
# 2.47 → 2.63.
BWD_RESIDENT_LOW = {16384: (1, 16)}
# The backward (plain and fused add) of 16-bit rows of exactly these lengths, every casting: the row held whole,
# (rows per program, warps) on one program per SM, N a compile-time constant, the weight loaded again for every row
# block and dweight's term added before the row's sum (``Config.reload_weight``: neither w_eff nor dy live across it;
# ptxas, bf16: no spills where the held tile spilled 56 bytes (llama) and 128-148 (gemma)). Thirty-eighth session (H100,
# launched by torch, kernels timed, three rounds alternating in one process; probes_h100_2026-11-27_thirtyeighth.md
# §1), TB/s, the heuristic → this: bf16 llama (BWD_RESIDENT_LOW's held tile) 4096×16384 2.71 → 2.77, 32768×16384
# 2.83 → 2.95; bf16 gemma (bands) 2.58 → 2.76, 2.67 → 2.92; float16 (held) 2.55 → 2.70, 2.67 → 2.92. The fused
# add's (bands before; 4·M·N·2 bytes, §3): bf16 llama 2.55 → 2.88, 2.63 → 3.03, gemma 2.65 → 2.89, 2.72 → 3.04,
# float16 2.78 → 2.89, 2.85 → 3.03 (32 warps: 2.72-2.90). With run-time N it spills again and reads below the held
# tile (2.52-2.78): ragged full rows keep BWD_RESIDENT_LOW or bands.
BWD_RESIDENT_RELOAD = {16384: (1, 16)}
# rms_norm's resident backward (not the fused add's, not the pieces) of full rows of these lengths, up to this many
# rows (None: any), compiles with N a compile-time constant (``Config.n_const``, as the forward's FWD_N_CONST): a power
# of two, so ``sum(g·x) / N`` and the masks keep their bits (dx and dweight digests equal off and on at every shape
# measured). Thirty-fifth session (H100, launched by torch, kernels timed, three rounds alternating in one process;
# probes_h100_2026-11-27_thirtyfifth.md §3), TB/s off → on: bf16 llama 4096×2048 2.27 → 2.43 (its main kernel 19.86
# → 18.54 µs, the Pallas binary's 18.66: the previous session's 7% gap), 8192×2048 +4.3%, 16384×2048 +3.4%, but
# 32768×2048 2.81 → 2.75 (-2.0 to -2.6%): hence the row limit; 4096×1024 +1.2% (bf16, fp16, gemma), 32768×1024 +0.1
# to +0.5%; fp16 and gemma at 2048 level. 4096-16384 columns level (±0.7%): not taken. The fused add's backward
# loses with it (4096×1024 -5.0%, 2048 -0.3%).
BWD_N_CONST = {1024: None, 2048: 16384}
# The resident backward of rows of these widths holds them as their two power-of-two pieces (``Config.pieces``,
# ``triton_pieces``; 2304 = 2048 + 256 instead of 4096 with 1792 masked lanes) in programs of one row: (warps, programs
# per SM, prefetch); the Pallas kernels' widths (pallas_config.BWD_PIECES), each with the tile fastest for the plain
# and the fused add's backward together (one tile: the fused add's dweight is the plain one's bits). Twenty-second
# session (H100, bf16, kernels timed over rotated inputs, `python -m bench.bwd_candidates ... --triton --pieces`,
# bench/results/triton_bwd_pieces_h100.md), plain / fused add TB/s against the padded tile: 32768×2304 2.49 / 2.63 →
# 2.78 / 2.82, 4096×2304 2.08 / 2.27 → 2.13 / 2.31; 32768×2560 2.57 / 2.76 → 2.83 / 2.91, 4096×2560 2.17 / 2.40 →
# 2.24 / 2.44; 32768×5120 2.61 / 2.75 → 2.83 / 2.95, 4096×5120 2.33 / 2.52 → 2.39 / 2.62.
BWD_PIECES = {2304: (4, 4, False), 2560: (4, 4, False), 5120: (8, 2, False)}
# rms_norm's backward (not the fused add's) of those rows: (warps, prefetch) on BWD_PIECES' grid, one row per program
# at a time, so dweight keeps the fused add's bits (dx's follow the warps). Twenty-fourth session (H100, bf16, kernels
# timed over rotated inputs; bench/results/probes_h100_2026-11-26_twentyfourth.md §8), plain TB/s at 4096 / 32768
# rows: 2304 2.14 → 2.28, 2.76 → 2.86; 2560 2.25 → 2.36, 2.83 → 2.87; 5120 2.40 → 2.53, 2.83 → 2.84.
BWD_PIECES_PLAIN = {2304: (2, True), 2560: (2, True), 5120: (4, True)}
# Per GPU model: the fused add's backward of these widths where the weight's product is in the row dtype (Llama's
# casting, g rounded) on this (warps, programs per SM, prefetch) instead of BWD_PIECES' (the plain backward's tile:
# dweight keeps its bits). Fifty-first session (H200, bf16, kernels timed over rotated inputs, two rounds, the slower
# quoted; probes_h200_2026-11-29_fiftyfirst.md §2), TB/s at 4096 / 32768 rows: Llama 2304 2.87 / 3.64 → 3.10 / 4.06.
# Gemma's product (g unrounded) lost there, 3.13 / 4.08 → 2.69 / 3.48; at 2560 Llama lost 13%, Gemma 23-29%. The
# Pallas kernels' tile (ffi_tables.BWD_FFI_PIECES_BY_MODEL, fiftieth session) takes it for both products.
BWD_PIECES_FUSED_LOW_BY_MODEL: dict[str, dict[int, tuple[int, int, bool]]] = {"h200": {2304: (2, 4, True)}}
