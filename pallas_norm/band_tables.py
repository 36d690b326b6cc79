"""Column bands' tables (``bands.py``, both stacks): which rows take bands, and the band grid's shape on a GPU.

``pallas_config.bands_config`` and ``torch_bridge.triton_config.bands_config`` build their configs from these.
"""

from __future__ import annotations

# Long rows (the backward from BANDS_MIN_COLS columns, the forward from pallas_config.FWD_BANDS_MIN_COLS): column bands
# of every row (``bands.py``: x (and dy) read once; the forward 2 passes, the backward 3), each band's programs walking
# the rows in ``groups`` interleaved row groups (the grid: bands × groups, ``programs_per_sm`` per SM). A row group's
# bands must be co-resident to run at speed (each waits for its peers' row sums); groups beyond what the GPU holds at
# once run in later waves.
# Tenth session (bench/results/sweep_h100_bfloat16_llama_bands_groups.md): 4-warp programs on 2048-column bands of
# 2 rows, the forward in 4 groups 2.72 TB/s, the backward in 2 groups 2.60, launched by torch. One group of many
# rows per step keeps few programs per SM, each step a chain of dependent loads and reductions: more, smaller
# programs hide each other's latency (ncu: DRAM 49-55% busy in one group). But XLA launches every kernel that uses
# dynamic shared memory at the most shared memory (``bench carveout``), which leaves L1 too small for the band's
# second read: the same kernels read 2.31 / 2.28 from JAX. Eleventh session: carrying the blocks in registers
# (``Config.carry``, sweep_h100_bfloat16_llama_pallas_bands_carveout100.md) gave 2.52 / 2.30 at either carveout;
# one-warp programs need no shared memory at all (no cross-warp reduction), so XLA leaves the carveout to the
# driver, and many of them hide each other's latency best: 1024-column bands of one row, lag 2, prefetch, the
# forward 16 programs per SM (8 groups) 2.82 TB/s launched by torch, 2.79 by XLA; the backward 8 per SM (4 groups)
# 2.78 / 2.77 (bench/results/sweep_h100_bfloat16_llama_bands_one_warp.md). Then (band columns, rows per block, warps,
# lag, prefetch, programs per SM). Bands only while a row has at most BANDS_MAX_PER_SM bands per SM (N ≤ 540672 on an
# H100): a group is then co-resident beside others; longer rows stay on the chunked paths.
# Thirteenth session (H100, bf16, bench/results/sweep_h100_bfloat16_llama_pallas_bands_from_16384.md, torch-launched;
# the one-warp bands use no shared memory, so XLA launches them the same): the band configs beat the resident
# backward at 16384 columns, which spills and under XLA's carveout reads 1.72 (4096×16384: bands 2.33; 32768×16384
# 1.94 → 2.63), and the chunked paths below 262144 (8192×32768 fwd 2.45 → 2.63, bwd 1.76 → 2.64; 4096×65536 2.39 →
# 2.69, 1.77 → 2.67; 2048×131072 2.20 → 2.74, 1.76 → 2.72; the chunked figures at XLA's carveout): so the backward
# takes bands from BANDS_MIN_COLS and the forward for rows longer than it holds (FWD_BANDS_MIN_COLS); the resident
# forward at 16384 stays (2.72 at XLA's carveout against 2.48 on bands). On Hopper ``auto`` still runs Mosaic GPU
# at 16384-131072 columns (faster there); this is the Triton lowering's own choice (``impl="pallas"``, pre-Hopper
# GPUs, rows of no multiple of 128 columns). A backward small enough for one program keeps it (one launch). Then
# below 16384 (bench/results/sweep_h100_bfloat16_llama_pallas_bands_below_16384.md): the resident backward pads
# 8193-16383 columns to 16384 and spills; at XLA's carveout it read 1.83 / 2.28 at 4096 / 32768×12288 and 1.69 /
# 2.23 at ×10240, bands 2.00 / 2.50 and 1.82 / 2.24: the backward takes bands for rows longer than 8192.
BANDS_MIN_COLS = 8193
# Program slots a band grid leaves free (``band_groups``). The one-warp backward takes 255 registers per thread, so
# an SM holds 8: BANDS' 8 per SM is the GPU's whole capacity, and at 16384 columns (16 bands × 66 groups) the grid
# filled it. Then one CTA of any other stream's kernel left a band of a group for a second wave, its peers spinning
# to SPIN_LIMIT and recomputing (correct, slow). H100, bf16, beside one one-thread kernel on another stream
# (thirteenth session, ``python -m bench contention``, bench/results/contention_h100.md; Triton reference / Pallas
# kernels): 32768×16384 backward 2.54 → 1.70 / 2.62 → 1.87, 8192×32768 2.49 → 1.70 / 2.61 → 1.84 with every slot
# asked; with 32 left free 2.49 → 2.49 / 2.57 → 2.57 and 2.46 → 2.49 / 2.61 → 2.55 (alone 0-2% below the full
# grid). The 1024 programs of 262144 columns already left 32 free and held their speed.
BANDS_SPARE = 32
BANDS_MAX_PER_SM = 4
BANDS = (1024, 1, 1, 2, True, 8)
FWD_BANDS = (1024, 1, 1, 2, True, 16)
# The walk of full blocks (``bands._full_walk``: where every row block of every group and every band is full, the
# steady state's loads and stores unmasked, the column mask constant; the same bits). Fifty-fourth session (H200, bf16,
# A/B against the masked walk, launched by torch, Llama / Gemma; probes_h200_2026-11-29_fiftyfourth.md): the forward
# at 65536-262144 columns -0.4..+0.7% plain, the fused add's +12-14% at 65536-131072 (-0.3..+1.5% at 262144); the
# backward at 32768-262144 +0.1..+1.0% plain, the fused add's +0.6..+7.4% up to 131072 but -7.5% / -8.7% at 262144
# (256 bands; the constant column mask alone -11%; ncu from JAX: fewer instructions, more long-scoreboard stalls,
# 522 → 565 us; not understood): the fused add's backward of more bands keeps the masked walk.
FULL_WALK_ADD_BWD_MAX_BANDS = 128
# The fused add's backward with g in the row dtype (bf16 Llama: ``bands._bwd_kernel``'s ``low``) reads its first band
# of x and dy without the L2 ``evict_last`` hint (``bands._first_read``) up to this many columns. Fifty-fifth session
# (H200, bf16, the heuristic's configs launched by torch, TB/s hinted → not; probes_h200_2026-11-29_fiftyfifth.md):
# Llama 32768×10240 3.59 → 3.71, 32768×12288 level, 8192×24576 3.64 → 3.82, 8192×32768 3.67 → 3.87 (+5.5%, +6.8%
# in a first run), 4096×65536 3.93 → 3.99; beyond, 2048×131072 -0.7%, 1024×262144 -1.0%. Gemma's (float32 g) -1.0%
# to +1.7%, rms_norm's backward -0.2% to -0.7% at every width: both keep the hint. Neither read hinted: -3% to -9%.
ADD_BWD_UNHINTED_MAX_COLS = 65536


def full_blocks(m: int, n: int, block_rows: int, block_cols: int, groups: int, *, add_backward: bool = False) -> bool:
    """Whether a band walk of ``m`` rows of ``n`` in ``groups`` interleaved row groups may walk full blocks (the Pallas
    band kernels; the Triton reference's plain backward, ``triton_bands._full``): every row block of every group
    full, every band full, and for the fused add's backward at most ``FULL_WALK_ADD_BWD_MAX_BANDS`` bands."""
    blocks, bands = -(-m // block_rows), -(-n // block_cols)
    return (m % block_rows == 0 and blocks % groups == 0 and n % block_cols == 0
            and not (add_backward and bands > FULL_WALK_ADD_BWD_MAX_BANDS))


def walks_full_blocks(steps: int, lag: int, prefetch: bool) -> bool:
    """Whether a walk of ``steps`` row blocks per group, every one full (``full_blocks``), runs as three loops (both
    stacks): it prefetches and finishes each block ``lag`` blocks late, with more blocks than the lag."""
    return prefetch and 0 < lag < steps


def add_bwd_unhinted(n: int, dtype_name: str, low: bool) -> bool:
    """Whether the fused add's band backward reads its first band of x and dy without a cache hint: g in the row dtype
    (``low``), bf16 rows of at most ``ADD_BWD_UNHINTED_MAX_COLS`` columns."""
    return low and dtype_name == "bfloat16" and n <= ADD_BWD_UNHINTED_MAX_COLS


def band_grid(n: int, sms: int, *, backward: bool, min_cols: int) -> tuple[tuple, int] | None:
    """The band table of a direction (``BANDS``/``FWD_BANDS``) and the row groups of its grid for rows of ``n``
    columns on a GPU of ``sms`` SMs, or None where rows take no bands: shorter than ``min_cols``, or more than
    ``BANDS_MAX_PER_SM`` bands per SM (both stacks' band heuristics)."""
    table = BANDS if backward else FWD_BANDS
    bands = -(-n // table[0])
    if n < min_cols or bands > BANDS_MAX_PER_SM * sms:
        return None
    return table, band_groups(bands, table[-1], sms)


def band_groups(bands: int, per_sm: int, sms: int) -> int:
    """Row groups of a band grid asking ``per_sm`` programs per SM of a GPU of ``sms`` SMs, less ``BANDS_SPARE``
    program slots (at least one group): the grid is ``bands`` × groups programs (both stacks' band heuristics, and
    the sweep's band candidates)."""
    return max(1, (per_sm * sms - BANDS_SPARE) // bands)
