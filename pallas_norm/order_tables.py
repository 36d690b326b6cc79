"""The Pallas kernel bodies' order choices by row width: when the weight is loaded, when the fused add stores h,
where the backward sums dweight's tile rows; with the H100 measurements behind them. ``kernels`` imports them and its
bodies read them there when traced (tests patch ``kernels.DW_PER_ROW`` and the others).
"""

from __future__ import annotations

# With y's product in the input dtype, resident rows of at most this many columns load the weight before the row (its
# latency hidden behind the row's); longer rows after it: held from the start it cost the fused add's forward 6% at
# 16384 columns (H100, bf16, from JAX, 4·M·N·2 bytes: 4096×16384 2.97 → 2.80, 32768×16384 3.00 → 2.87; the plain
# forward ties there; probes_h100_2026-11-26_twentyfirst.md §5).
WEIGHT_FIRST_MAX_COLS = 8192
# Where y's product stays float32 (gemma's casting, an offset, a weight not in the input dtype), rms_norm's resident
# rows of at most this many padded columns load the weight before the row too. H100, bf16 gemma, impl=None, kernels
# timed, alternating processes (probes_h100_2026-11-27_twentyseventh.md §3): 4096×1024 2.37 → 2.43 TB/s, 8192×1024
# +0.3%, 2048×1024 and 4096×2048 level (so not beyond 1024); the same bits. The fused add (h stored first at these
# rows, H_FIRST_MAX_COLS) keeps its order: not measured this way.
WEIGHT_FIRST_F32_MAX_COLS = 1024
# The fused add's resident forward stores h before the row's sum (as the Triton reference does) up to this many
# padded columns, after y's math beyond. H100, bf16, impl=None, kernels timed (probes_h100_2026-11-27_twentyfifth.md
# §9), h last → first, TB/s (4·M·N·2 bytes): 4096×1024 llama 2.42 → 2.75, gemma 2.72 → 2.75, 32768×1024 level;
# 2048-8192 columns level (±0.3%), gemma 4096×2304 2.77 → 2.74. The same values stored: the same bits.
H_FIRST_MAX_COLS = 1024
# Resident tiles of several rows of these padded widths keep dweight's terms per tile row and sum the rows once after
# the loop (the Triton reference's way), not every block (a cross-warp sum, three barriers per block at 256 columns).
# H100, bf16, impl="pallas" from JAX, plain / fused add TB/s, off → on (probes_h100_2026-11-28_thirtyninth.md §5):
# 1048576×256 2.74 / 2.83 → 2.90 / 2.94, 65536×256 2.38 / 2.54 → 2.58 / 2.67 (jaxlib's launch 1.24 / 1.60 → 2.88 /
# 3.00); 64 and 128 columns lost on their old tiles (2.85 → 2.44, 2.78 → 2.50) and gain on 256's
# (ffi_tables.BWD_FFI_RESIDENT's fortieth-session note). 512 (forty-first session, BWD_RESIDENT's 8-row tile, two
# rounds in alternating processes; probes_h100_2026-11-28_fortyfirst.md §1), XLA's launch, plain / fused add:
# 524288×512 2.83 / 2.91 → 2.93 / 2.76, 65536×512 2.62 / 2.74 → 2.77 / 2.61, 8192×512 1.80 / 1.96 → 1.93 / 1.85;
# jaxlib's launch of the per-row tile 2.89 / 2.99, 2.69 / 2.77, 1.52 / 1.69 (of the per-block one 1.20 / 1.56 at
# 524288 rows): so from BWD_FFI_MIN_ROWS_PER_SM rows per SM jaxlib launches it (ffi_tables).
DW_PER_ROW: frozenset[int] = frozenset({64, 128, 256, 512})
# The fused add's resident backward at these padded widths loads a row block's dh_out within that block ("block": at
# its start; "use": where dx adds it, after the row's sum) instead of with the block's x and dy, which a prefetching
# config loads one block ahead (dh_out then live across the loop). The same values, the same bits. Offline
# (``python -m bench.offline``, forty-first session; probes_h100_2026-11-28_fortyfirst.md §12), registers
# prefetched → "use": 8192×512 149 → 123 (XLA's launch: 1 → 2 programs per SM, the fused add's loss in §7),
# 524288×512 under jaxlib's cap 128 + 8 B spilled → 124, 4096×16384 128 + 44 B spilled → 128, 1048576×256 126 → 124;
# "block": 128, 128, 128 + 44 B, 120. Forty-second session (H200, bf16, from JAX, kernels timed, alternating processes;
# probes_h200_2026-11-28_fortysecond.md §4), fused add TB/s, prefetched → "use" / "block": 4096×16384 3.10 → 3.89 / –,
# 32768×16384 3.30 → 4.16 / –, 8192×512 2.16 → 2.54 / 2.60, 65536×512 3.61 → 3.77 / –, 524288×512 4.09 → 4.24 /
# 4.13; left out: 32768×4096 4.27 → 4.21 / 4.27, 1048576×256 4.00 → 3.91 / –. The plain backward unchanged.
DH_LOAD: dict[int, str] = {512: "use", 16384: "use"}
