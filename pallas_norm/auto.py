"""``impl="auto"`` (what ``impl=None`` runs on a GPU): per direction and shape the faster of the two lowerings of
the kernels, from the committed H100 bench, never a guess.

Two H100 runs (bf16) timing both lowerings through JAX after the sweep ``sweep_h100_bfloat16_llama_mosaic.md``
retuned the Mosaic kernels (``bench/results/mosaic_h100_bfloat16_llama.md`` and the suite
``bench_h100_bfloat16_llama.md``): the Mosaic GPU backward reads x and dy once and beat the Triton lowering's at
most N ≤ 65536 of the grid (32768×16384 2.48–2.49 against 1.82–1.90 TB/s, 8192×32768 2.26–2.29 against 1.67–1.69,
4096×65536 1.89 against 1.58–1.70), except at N = 8192, where the Triton lowering's backward was faster in both
(2.61–2.67 against 2.46–2.47); the Mosaic forward won only on rows split over a cluster (8192×32768 2.52–2.53
against 2.31–2.33, 4096×65536 2.43–2.50 against 2.25–2.26) and lost on rows one CTA holds. So, on GPUs that run
Mosaic GPU (compute capability >= 9.0) and rows that need no padding (a multiple of 128 columns): the backward
(plain and fused, which must agree: the fused add's ``dweight`` is ``rms_norm``'s bits) on Mosaic GPU from 1024 to
65536 columns but 8192 (per-head rows of 128 and 256 columns ran at a third and a half of the Triton lowering's
speed on Mosaic GPU, ``bench/results/fused_h100.md``: one element per thread and a warpgroup reduction per row), the
forward (plain and fused) for 16384 < N ≤ 65536 (widened later: below); everything else on the Triton lowering
(``"pallas"``), which also takes the longest rows (the Mosaic backward cannot hold them; its forward is slower
there). The suite rerun with the kernels timed by their own durations (same file, later) agrees, but for
32768×4096, where the Triton lowering's backward read 2% faster (2.71 against 2.65): within run-to-run noise, left
as it is. A config passed for a direction picks its lowering (``Config``: Triton, ``MosaicConfig``: Mosaic GPU).

Later (2026-11-24, fifth session): the Mosaic kernels' two-stage pipeline loads the next block before computing
the current one, and 131072-column forwards run one stage with two CTAs per SM: Mosaic's forward at 2048×131072
read 2.54 TB/s against the Triton lowering's 2.22, timed by kernel durations in the same process
(``sweep_h100_bfloat16_llama_mosaic_long.md``), so the forward runs on Mosaic GPU up to 131072 columns. Then
clusters of 16 CTAs (the same session, kernel-timed, one process): forward 2048×131072 2.75 and 1024×262144 2.20
against the Triton lowering's 2.22 and 2.00; backward 2048×131072 2.30 against 1.76. So the forward runs on Mosaic
GPU for 16384 < N ≤ 262144 and the backward for 1024 ≤ N ≤ 131072 (but 8192: below).

2026-11-25 (sixth session): the Mosaic backward holds each row's share in registers between its two walks
(``mosaic_config.holds``). Suite, kernels timed (``bench_h100_bfloat16_llama.md``): its backward at N = 8192 now
beats the Triton lowering's (32768×8192 2.85 against 2.81, 4096×8192 2.49 against 2.24), so 8192 is no longer an
exception. At 262144 the Mosaic backward runs (its ``dweight`` partial half in shared memory) but at 1.08 TB/s
against the Triton lowering's 1.77: the Triton lowering keeps that length. Since the ninth session the Triton
lowering's backward there runs on column bands (``band_tables.BANDS``, ``bands.py``: 2.16 TB/s, kernels timed).

2026-11-25 (tenth session): the column bands run in row groups and take the forward too; at 1024×262144 the Triton
lowering's forward reads 2.72 TB/s against Mosaic GPU's clusters' 2.36 (the sweep launched both through torch,
``sweep_h100_bfloat16_llama_bands_groups.md``), so the forward runs on Mosaic GPU only up to 131072 columns.
Eleventh session: the bands run one-warp programs (no shared memory: XLA's launch keeps the driver's carveout), JAX
at 1024×262144 fwd 2.81, bwd 2.77 TB/s. Twelfth session, timed from JAX below 262144: they tie Mosaic GPU at 65536
and 131072 columns and lose at 32768 (8192×32768 fwd 2.68 against 2.74, bwd 2.63 against 2.79; docs/benchmarks.md),
so the table stands. Thirteenth session: the Triton lowering's backward moved to those bands beyond 8192 columns,
its forward beyond 16384 (``band_tables.BANDS_MIN_COLS``); from JAX, bf16 (``bench_h100_bfloat16_llama.md``)
Mosaic GPU stays faster at 16384-32768 columns (backward 32768×16384 2.89 against 2.62, 8192×32768 2.78 against
2.65) and ties at 65536-131072 (4096×65536 2.68 against 2.70, 2048×131072 2.76 against 2.76): the table stands.

Fourteenth session: the Triton lowering's dweight reduction sums its partial rows in tiles (1.4-3.4 µs, was 5.4 and
more) and its resident backward runs more, smaller programs below 4096 columns (``pallas_config.BWD_RESIDENT``).
Timed from JAX with Mosaic GPU beside it (H100, bf16, ``bench/results/sweep_h100_bwd_jax_2026-11-26.md``, plain /
fused TB/s): the Triton lowering now wins where its padded row is well filled, 4096×1024 1.90 / 2.06 against
Mosaic's 1.64 / 1.89, 32768×1024 2.74 / 2.83 against 2.58 / 2.71, 4096×2048 2.31 / 2.44 against 2.06 / 2.24,
32768×2048 2.88 / 2.94 against 2.65 / 2.85, 32768×3584 2.80 / 2.91 against 2.76 / 2.90, 32768×4096 2.87 / 2.95
against 2.71 / 2.89, 4096×8192 2.70 / 2.73 against 2.59 / 2.70 (32768×8192 2.90 / 2.90 against 2.84 / 2.95), and
loses where it pads a quarter or more of the row: 32768×2304 2.48 / 2.70 against 2.66 / 2.81, 32768×5120 2.58 /
2.61 against 2.73 / 2.89 (4096×2304 2.10 / 2.32 against 2.05 / 2.26, a tie). So the backward of rows of at most
``TRITON_BWD_COLS`` columns that fill more than ``pallas_config.PADDED_FILL`` of their padded length takes
the Triton lowering; Mosaic GPU keeps the rest of 1024-131072.

Nineteenth session: where ``triton_ffi`` is available (the ``triton`` package beside a CUDA jaxlib, Hopper), the
Triton lowering's forward (plain and fused add) of full rows of 32768 columns (padded length 32768, more than 3/4
filled) holds them in registers and is launched by jaxlib's Triton call, outside XLA's carveout
(``pallas_config.FWD_FFI_RESIDENT``): 8192×32768 2.99 TB/s against Mosaic GPU's 2.74, the fused add's 3.01 against
2.74 (``bench/results/ffi_launch_h100.md``, ``probes_h100_2026-11-26_nineteenth.md``), so that forward leaves
Mosaic GPU.

Twenty-first session: the Triton lowering's backward holds rows of 2304, 2560 and 5120 columns as their power-of-two
pieces (``pallas_config.BWD_PIECES``). From JAX (H100, bf16, ``bench/results/bwd_pieces_h100.md``, plain / fused
TB/s) it beats Mosaic GPU at 2304 (32768 rows 2.72 / 2.85 against 2.64 / 2.83; 4096 rows 2.11 / 2.33 against 2.14 /
2.27), ties or loses at 2560 (2.63 / 2.82 against 2.67 / 2.86) and 5120 (32768 rows 2.76 / 2.80 against 2.74 / 2.88;
4096 rows 2.38 / 2.51 against 2.39 / 2.52): so the backward of rows of ``TRITON_BWD_PIECES`` columns takes the
Triton lowering.

Twenty-second session: the Triton lowering's resident backward of full rows of 2048, 4096 and 8192 padded columns is
launched by jaxlib's Triton call where ``triton_ffi`` is available (``pallas_config.BWD_FFI_RESIDENT``), which widens
its lead over Mosaic GPU there (32768×4096 plain / fused 2.91 / 3.03 against 2.72 / 2.89, 32768×8192 2.93 / 3.03
against 2.85 / 2.94; ``bench/results/probes_h100_2026-11-26_twentysecond.md`` §3): no change of lowering.

Twenty-third session: so is its backward of rows held as pieces (2304, 2560, 5120 columns), on the Triton
reference's tiles (``pallas_config.BWD_FFI_PIECES``), which XLA's launch had collapsed, and of full rows of 1024
padded columns, the assembler held to the registers that let the persistent grid's programs fit at once
(``pallas_config.register_cap``). Plain / fused add TB/s against Mosaic GPU: 32768×5120 2.86 / 2.88 against 2.74 /
2.87, 4096×5120 2.48 / 2.59 against 2.37 / 2.50 (``bench/results/bwd_pieces_ffi_h100.md``), 32768×2560 2.86 / 2.89
against 2.69 / 2.86, 4096×2560 2.26 / 2.39 against 2.19 / 2.34 (``probes_h100_2026-11-26_twentythird.md`` §2): where
jaxlib launches it (``pallas_config.ffi_backward``), that backward leaves Mosaic GPU.

Forty-first session: the backward of 16-bit rows of 16384 columns that the Triton lowering holds whole
(``pallas_config.ffi_held``, jaxlib's launch; thirty-eighth session) leaves Mosaic GPU where the rows are few:
up to ``HELD_BWD_MAX_ROWS_PER_SM`` per SM. H100, ``bench kernels``, two processes
(``bench/results/probes_h100_2026-11-28_fortyfirst.md`` §9), Mosaic GPU → held, TB/s: 4096×16384 bf16 llama 2.71 →
2.77 (main kernel 146 → 142 µs), fp16 2.72 → 2.78, bf16 gemma 2.74 → 2.75; the fused add's backward level (2.81 /
2.82). At 32768 rows (248 per SM) the two are level (±0.5%) and Mosaic GPU's fused add leads by 0.5%, so it stays
there; in between untimed.

Forty-fourth session, on the H200 (``TRITON_BWD_BY_MODEL``): the backward of 16-bit rows of 16384 to 131072 columns
takes the Triton lowering at every row count, held whole at 16384 (jaxlib's launch), column bands beyond. From JAX,
bf16 llama, kernels timed, two rounds in one process (``bench/results/probes_h200_2026-11-28_fortyfourth.md`` §4),
Mosaic GPU → Triton lowering, plain / fused add TB/s: 8192×16384 3.46 / 3.73 → 3.94 / 4.03, 16384×16384 3.58 / 3.82
→ 4.05 / 4.12, 32768×16384 3.63 / 3.86 → 4.09 / 4.17, 8192×32768 3.27 / 2.74 → 3.29 / 3.32, 4096×65536 3.27 / 2.86
→ 3.28 / 3.34, 2048×131072 3.08 / 2.45 → 3.39 / 3.37. So does the forward of 16-bit rows of 65536 and 131072
columns (``TRITON_FWD_BY_MODEL``; column bands), the same way (§5): 8192×65536 3.54 / 2.76 → 3.71 / 3.26, 4096×65536
3.47 / 2.82 → 3.70 / 3.27, 2048×131072 3.18 / 2.69 → 3.70 / 3.27 (32768 is jaxlib-launched already). The H100 keeps
the rules above. Fifty-sixth session, the same way (``probes_h200_2026-11-29_fiftysixth.md`` §3): the backward at
20480 and 24576 columns (Mosaic GPU's config padded to 32768), Mosaic GPU → column bands, plain / fused add, llama:
16384×20480 2.64 / 2.40 → 3.57 / 2.52, 8192×24576 2.91 / 2.56 → 3.55 / 2.68; gemma 8192×24576 3.21 / 2.62 → 3.53 /
2.53 (the fused add −3.4%, kept with its plain backward: one lowering keeps its dweight rms_norm(h)'s bits). Rows of
fewer than 16384 columns stay on Mosaic GPU (2 CTAs per SM there: ``mosaic_config.BWD_PER_SM_BY_MODEL``; 32768×10240
4.03 / 2.76 against the bands' 3.51 / 2.58); other widths above 16384 were not timed.
"""

from __future__ import annotations

from . import backend
from .mosaic_config import MosaicConfig
from .pallas_config import (MAX_RESIDENT_COLS, ffi_backward, ffi_forward, ffi_held, from_rows_per_sm, full_row,
                            one_program, this_model)

MOSAIC_BWD_COLS = (1024, 131072)  # the backward runs on Mosaic GPU for lo <= N <= hi, but:
TRITON_BWD_COLS = 8192  # rows of at most this many columns filling more than PADDED_FILL of a power of two
TRITON_BWD_PIECES = frozenset({2304})  # and rows of these widths (held as their pieces: pallas_config.BWD_PIECES)
MOSAIC_FWD_COLS = (16384, 131072)  # the forward runs on Mosaic GPU for lo < N <= hi
MOSAIC_ALIGN = 128
HELD_BWD_MAX_ROWS_PER_SM = 32  # the held 16384-column backward (pallas_config.ffi_held) up to this many rows per SM
# Per GPU model: the backward of 16-bit rows of these widths on the Triton lowering at every row count (held whole
# where pallas_config.ffi_held, column bands beyond MAX_RESIDENT_COLS).
TRITON_BWD_BY_MODEL: dict[str, frozenset[int]] = {"h200": frozenset({16384, 20480, 24576, 32768, 65536, 131072})}
# Per GPU model: the forward (plain and fused add) of 16-bit rows of these widths on the Triton lowering (column bands).
TRITON_FWD_BY_MODEL: dict[str, frozenset[int]] = {"h200": frozenset({65536, 131072})}
# Per GPU model: the forward (plain and fused add: one lowering, so the fused add's y stays rms_norm(h)'s bits) of
# 16-bit rows of these widths with a weight whose product is taken in float32 (Gemma's casting, or a float32 weight;
# not ``product_in_dtype``) on Mosaic GPU, below this many rows per SM (None: every row count; from it
# ffi_tables.FWD_FFI_XLA_TILE_BY_MODEL's jaxlib launch). Forty-eighth session (H200, bf16 and fp16, from JAX and by
# torch's launch route, kernels timed over rotated inputs, two rounds, the slower quoted;
# bench/results/probes_h200_2026-11-29_fortyeighth.md §1), impl=None → Mosaic GPU, Gemma plain / fused add / by torch
# TB/s: 4096×2304 3.23 / 3.66 / 3.25 → 3.53 / 3.69 / 3.53, 16384×2304 3.88 / 4.08 / 4.03 → 4.10 / 4.11 / 4.09,
# 4096×2048 3.26 / 3.82 / 3.25 → 3.50 / 3.81 / 3.47, 4096×1152 2.69 / 3.43 / 2.67 → 3.02 / 3.46 / 2.97, 32768×4608
# 3.87 / 4.07 / 4.07 → 4.18 / 4.15 / 4.17, 4096×3072 3.35 / 3.75 / 3.53 → 3.64 / 3.81 / 3.67. The bounds: where
# Mosaic GPU's plain forward stops gaining (32768×2048 −0.3%, 16384×1536 −0.6%) or jaxlib's launch of the Triton
# lowering's tile takes over (32768×2304 4.19 / 4.26 / 4.19 against Mosaic GPU's 4.16 / 4.18 / 4.19). Its fused add
# loses 1.4-2.1% at 16384-32768 rows of 1152 and 2048 rows of 2304, where the plain forward gains 3-16%. Llama's casting
# with a float32 weight gains alike (plain, +0.2% at 4096×1536 to +18% at 32768×4608); without a weight (no product)
# Mosaic GPU loses 0.3-2.9% but at 1152, and Llama's product in the row's dtype at few rows (4096×2304 −5.5%): not
# taken.
MOSAIC_FWD_F32_BY_MODEL: dict[str, dict[int, int | None]] = {"h200": {
    1152: None, 1536: 32, 2048: 64, 2304: 128, 2560: 128, 3072: 64, 4608: None}}


def lowering(backward: bool, n: int, config: object = None, *, m: int | None = None,
             itemsize: int | None = None, float32_product: bool = False) -> str:
    """``"pallas"`` or ``"mosaic"`` for one launch of ``m`` (when known) rows of ``n`` ``itemsize``-byte (when known)
    columns. A backward of at most ``pallas_config.ONE_PROGRAM_ELEMS`` elements takes the Triton lowering, which runs
    it as one launch (one program storing dweight; Mosaic's is two: its kernel and the partials' reduction): such
    calls are host-bound. So does a backward the Triton lowering holds whole (``ffi_held``) of at most
    ``HELD_BWD_MAX_ROWS_PER_SM`` rows per SM, and on the GPU model ``TRITON_BWD_BY_MODEL`` (``TRITON_FWD_BY_MODEL``)
    names, the backward (forward) of 16-bit rows of its widths at every row count. On the GPU model
    ``MOSAIC_FWD_F32_BY_MODEL`` names, the forward of 16-bit rows of its widths with a weight whose product is taken
    in float32 (``float32_product``: not ``kernels.product_in_dtype``) runs on Mosaic GPU below its rows per SM."""
    if config is not None:
        return "mosaic" if isinstance(config, MosaicConfig) else "pallas"
    if n % MOSAIC_ALIGN or not backend.mosaic_capable():
        return "pallas"
    if backward and m is not None and one_program(m, n):
        return "pallas"
    if backward:
        lo, hi = MOSAIC_BWD_COLS
        held = m is not None and itemsize is not None and ffi_held(m, n, itemsize)
        wide = itemsize == 2 and n in this_model(TRITON_BWD_BY_MODEL) and (held or n > MAX_RESIDENT_COLS)
        triton = (n <= TRITON_BWD_COLS and full_row(n)) or n in TRITON_BWD_PIECES or ffi_backward(n) or wide or (
            held and m <= HELD_BWD_MAX_ROWS_PER_SM * backend.num_sms())
        mosaic = lo <= n <= hi and not triton
    else:
        lo, hi = MOSAIC_FWD_COLS
        wide = itemsize == 2 and n in this_model(TRITON_FWD_BY_MODEL)
        mosaic = (lo < n <= hi and not ffi_forward(n) and not wide) or (
            itemsize == 2 and float32_product and _below(this_model(MOSAIC_FWD_F32_BY_MODEL), n, m))
    return "mosaic" if mosaic else "pallas"


def _below(table: dict, n: int, m: int | None) -> bool:
    """Whether ``table`` names ``n`` and ``m`` (when known) rows are below its rows per SM (None: every row count)."""
    if n not in table:
        return False
    bound = table[n]
    return bound is None or (m is not None and not from_rows_per_sm(m, bound))
