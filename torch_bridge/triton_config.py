"""Tiling of the Triton reference kernels: a frozen ``Config`` per launch, and the heuristics that pick one per
row length. ``triton_kernels.rms_norm_fwd/bwd(..., config=...)`` force one (tests cover the long-row paths with
small ones; ``python -m bench sweep`` times alternatives). The backward's tile tables live in ``triton_bwd_tables``
(re-exported here)."""

from __future__ import annotations

import dataclasses
import functools

from pallas_norm import band_tables, l1_hints, pallas_config

from .triton_bwd_tables import (BWD_FEW_WARPS_MAX_N, BWD_HEADS, BWD_N_CONST, BWD_PIECES, BWD_PIECES_FUSED_LOW_BY_MODEL,
                                BWD_PIECES_PLAIN, BWD_PREFETCH_N, BWD_RESIDENT_LOW, BWD_RESIDENT_RELOAD)

FUSED_MAX_N = 16384  # rows up to this length are held in registers (one pass; the backward)
# The forward holds rows up to this length in registers (16 warps: 64 elements per thread at 32768). H100, bf16,
# kernels timed (2026-11-24, fifth session): 8192×32768 3.00 TB/s against 2.36 in column chunks (the fused add
# 3.00 against 2.14); 4096×65536 held whole read 1.92–1.98 against 2.13 chunked, so longer rows stay chunked.
FWD_RESIDENT_MAX_N = 32768
CHUNK_N = 8192  # column chunk of the long-row forward and of the backward's row-dot pass
BWD_CHUNK_N = 4096  # column chunk of the long-row backward
TILE_ELEMS = 4096  # elements per program tile (rows per program = TILE_ELEMS // block_n)
# The forward of rows filling more than ``pallas_config.PADDED_FILL`` of their padded length, by that length: (rows
# per program, warps) instead of the TILE_ELEMS rule. H100, bf16, kernels timed from torch over rotated inputs, two
# rounds in one process (seventeenth session, `python -m bench.fwd_tiles`, bench/results/fwd_tiles_h100.md), TB/s:
# 4096×2048 (2, 4) 2.42 → 2.49, 32768×2048 2.87 → 2.94, 4096×3584 (1, 4) 2.62 → 2.66, 32768×3584 2.95 → 2.97,
# 4096×4096 2.62 → 2.65, 32768×4096 2.92 → 2.93, 4096×8192 (1, 8) 2.77 → 2.85, 32768×8192 2.95 → 2.99 (the rule's
# 1024 and 16384 tiles were the fastest; 4096's best, (2, 16), lost 2% at 3584). The fused add shares the tile but at
# FWD_ADD_RESIDENT's lengths.
# Thirty-third session, 1024 columns (probes_h100_2026-11-27_thirtythird.md §1-3, launched by torch, kernels timed):
# the plain forward on (2, 4) with the row length a compile-time constant (FWD_N_CONST, ``Config.n_const``), the fused
# add on the rule's (4, 4) (both lay a row over all 128 threads, 8 elements each: the same sum, so the fused add's y
# and rstd stay rms_norm(h)'s bits). Plain, (4, 4) → (2, 4) with N constant, three rounds in one process, TB/s: bf16
# llama 2048 rows 1.87 → 1.98, 4096 2.45 → 2.50, 8192 2.59 → 2.61, 16384-32768 level; gemma 4096 2.35 → 2.43; fp16
# 4096 2.42 → 2.50 (the Pallas binary 2.50-2.51). The fused add on (2, 4) loses 1-2% (with N constant 7%), and N
# constant on (4, 4) moves it by -0.6% to +0.1%.
FWD_RESIDENT = {1024: (2, 4), 2048: (1, 8), 4096: (1, 8), 8192: (1, 16)}
FWD_ADD_RESIDENT = {1024: (4, 4)}
# The plain forward's rows of exactly these lengths compiled with N constant. Only there: on rows with masked columns
# (1000 or 900 of 1024) N constant changed rstd's bits in 18-25% of rows (the compiled sum differs), and the fused
# add's y would no longer be rms_norm(h)'s bits.
FWD_N_CONST = frozenset({1024})
# Per GPU model, the forward (plain and fused add: one tile, so the fused add's y and rstd stay rms_norm(h)'s bits) of
# 16-bit rows of exactly these widths held whole: (rows per program, warps, n_const), wherever two passes
# (``pallas_config.two_pass_tile``) do not take them. With N constant the padded lanes past N drop out at compile time
# (the Pallas kernels always compile so: JAX's static shapes); at run-time N the plain forward does their math too.
# Forty-ninth session (H200, bf16, launched by torch, kernels timed over rotated inputs, two rounds, the slower quoted;
# probes_h200_2026-11-29_fortyninth.md §1), plain forward at 4096 / 32768 rows, heuristic → this, TB/s: llama 2304
# 3.15 / 3.96 → 3.35 / 4.18, gemma 2304 2.98 / 3.82 → 3.16 / 4.17; 2048 +3-8%; 2560 +3-6%; 3584 +2-5%; 3072 0 to +6%;
# 4608 +9-14%; 5120 +8-12% (Gemma's 4096 rows keep two passes); 5376 +7-11%; 6144 +2-6%; 7168 +10-14%; 8192
# +4-6%; 12288 gemma +19-20%, llama +1-2%; 16384 gemma +5-6%, llama -0.5 to -0.3%; 1024 -0.3 to +1.3%; float16 alike at
# 2048-16384 (§2). The fused add within -1.6% (Gemma's 4096×12288; 4096×4608 and 4096×6144 -1.1%) to +2%. Not 1152,
# 1536, 3840 (within ±1.4%) or 4096 (level).
FWD_RESIDENT_BY_MODEL: dict[str, dict[int, tuple[int, int, bool]]] = {"h200": {
    1024: (2, 4, False), 2048: (1, 4, True), 2304: (1, 4, True), 2560: (1, 4, True), 3072: (1, 4, True),
    3584: (1, 4, True), 4608: (1, 8, True), 5120: (1, 8, True), 5376: (1, 8, True), 6144: (1, 8, True),
    7168: (1, 8, True), 8192: (1, 4, False), 12288: (1, 8, True), 16384: (1, 8, True)}}
BWD_PROGRAMS_PER_SM = 2  # persistent grids (backward; long-row forward) = this × SM count (÷ column chunks)
# The resident backward's grid (the pieces' too, since the twenty-seventh session) is then trimmed to the fewest
# programs keeping the most row blocks per program (``pallas_config.balanced``, in ``triton_kernels.rms_norm_bwd``),
# as the Pallas kernels'.
# Twenty-fifth session (H100, bf16, launched by torch, kernels timed; probes_h100_2026-11-27_twentyfifth.md §7),
# plain / fused add TB/s: 4096×1024 1.92 / 2.14 → 1.99 / 2.21, 4096×2048 2.30 / 2.46 → 2.38 / 2.53, 4096×4096
# 2.52 / 2.66 → 2.59 / 2.72, 32768×1024 2.75 / 2.88 → 2.77 / 2.91; 4096×8192, 32768×2048 within 0.5%. Twenty-seventh
# session: the pieces (BWD_PIECES) too, plain / fused add: 4096×2304 2.29 / 2.32 → 2.36 / 2.39, 4096×5120 2.52 / 2.62
# → 2.59 / 2.67, 8192×2304 2.50 / 2.53 → 2.56 / 2.56, 32768 rows level (probes_h100_2026-11-27_twentyseventh.md §2).
# The Pallas kernels' pieces keep their grid: there it moved 4096×2304 -0.4%, 4096×2560 -0.6%, 4096×5120 +1.0%.
ONE_PROGRAM_ELEMS = 1 << 16  # backward inputs up to this size: one program per column chunk, dweight written directly
# Long rows (float32 compute; from BANDS_MIN_N / FWD_BANDS_MIN_N columns, below) on column bands (``triton_bands``): the
# Pallas kernels' band heuristic, read from its tables (``band_tables.BANDS``/``FWD_BANDS``: 1024-column bands of one
# row per block, one warp per program, lag 2, in row groups; the backward 8 programs per SM, the forward 16; rows with
# more than ``BANDS_MAX_PER_SM`` bands per SM stay chunked). H100, bf16, 1024×262144 (eleventh session,
# bench/results/sweep_h100_bfloat16_llama_bands_one_warp.md): the backward in 4 groups 2.54 TB/s against 2.16 for the
# tenth session's 4-warp programs on 2048-column bands of 2 rows; the forward in 8 groups 2.65 against 2.54
# (bench/results/triton_bands_h100.md: 1.76 chunked).
# The Triton reference takes bands where the Pallas kernels do: the backward from ``band_tables.BANDS_MIN_COLS`` (rows
# longer than 8192), the forward for rows longer than it holds (``FWD_RESIDENT_MAX_N``; its resident forward reads 2.98
# TB/s at 8192×32768 against 2.56 on bands). Thirteenth session (H100, bf16, CUDA events, one run,
# bench/results/sweep_h100_bfloat16_llama_triton_bands_from_16384.md): backward 4096×16384 2.12 → 2.31, 32768×16384 2.55
# → 2.55, 8192×32768 1.78 → 2.53, 4096×65536 1.78 → 2.55, 2048×131072 1.77 → 2.56; forward 4096×65536 2.11 → 2.61,
# 2048×131072 1.96 → 2.62 (the band tables' 8 and 16 programs per SM the fastest of 4, 8 and 16 at every shape; the grid
# then leaves ``band_tables.BANDS_SPARE`` slots free for other streams' kernels). Below 16384
# (sweep_h100_bfloat16_llama_triton_bands_below_16384.md, the grid with the spare): 4096×12288 1.90 → 2.22, 32768×12288
# 2.31 → 2.53, 4096×10240 1.74 → 2.12, 32768×10240 2.12 → 2.47 (the resident row padded to 16384).
BANDS_MIN_N = band_tables.BANDS_MIN_COLS  # the backward
# The band kernels load block t + 1 before block t's math (``Config.prefetch``, the Pallas band tables' choice): the
# backward (plain and the fused add's) at every band length, the plain forward up to ``FWD_BANDS_PREFETCH_MAX_N``
# columns. Thirty-sixth session (H100, launched by torch, kernels timed, four rounds taking turns;
# probes_h100_2026-11-27_thirtysixth.md §6), forward TB/s without → with, the same bits: bf16 4096×65536 2.64 → 2.73,
# 2048×131072 2.66 → 2.72, but 1024×262144 2.69 → 2.23 (256 bands), and the fused add's forward (two row operands)
# 4096×65536 2.50 → 2.41, 2048×131072 2.49 → 2.38, so not the fused add. The backward prefetches since the
# thirty-seventh session, when its fallback moved out of the waiting loop (``triton_bands._bands_bwd_kernel``: with
# the fallback inside, ptxas spilled 164-180 B per thread in bf16 and prefetch lost 16-19%). H100, kernels timed over
# three alternating rounds (probes_h100_2026-11-27_thirtyseventh.md §2-3), TB/s, bf16 llama unless noted. The
# previous kernel (no prefetch) → two loops with prefetch: 4096×16384 2.42 → 2.51, 8192×32768 2.56 → 2.65, 4096×65536
# 2.58 → 2.69, 2048×131072 2.61 → 2.73, 1024×262144 2.56 → 2.68; fp16 8192×32768 2.61 → 2.68, 2048×131072 2.68 →
# 2.77; gemma 4096×65536 2.67 → 2.77, gemma fp16 1024×262144 2.67 → 2.82. Two loops without → with prefetch:
# 4096×12288 2.34 → 2.45, 32768×16384 2.52 → 2.62, 512×540672 1.76 → 2.05; the fused add's backward (with dh) gains
# 1-13% (4096×65536 2.60 → 2.68, gemma 2048×131072 2.69 → 2.98, 512×540672 1.85 → 2.10).
FWD_BANDS_PREFETCH_MAX_N = 131072
FWD_BANDS_MIN_N = FWD_RESIDENT_MAX_N + 1


def next_pow2(v: int) -> int:
    return 1 if v <= 1 else 1 << (v - 1).bit_length()


def _warps(elems: int, per_warp: int) -> int:
    return max(1, min(16, elems // per_warp))


@dataclasses.dataclass(frozen=True)
class Config:
    """One launch's tiling: ``block_m`` rows × ``block_n`` columns per program (``block_n`` the padded row when it is at
    least N, else the column chunk), ``num_warps``; ``programs_per_sm`` (the persistent grid of the backward and of
    the long-row forward) and the long-row backward's row-dot pass's ``rowdot_block_n``/``rowdot_warps``. A backward
    of at most ``one_program_elems`` elements runs one program per column chunk, which stores dweight itself: one
    launch and no partials buffer instead of two launches (such calls are host-bound: the GPU time is a few µs
    either way, the host's ~2× that of a launch). ``lag`` > 0 (chunked rows, both directions): column bands of
    ``block_n`` (``triton_bands``), each row block finished ``lag`` blocks after its partial sums were posted;
    ``groups`` row groups (a grid of bands × groups; group g takes row blocks g, g + groups, ...). ``prefetch`` (the
    resident backward; bands, both directions): the next row block is loaded before the current one's math.
    ``pieces`` (the resident backward of rows of two power-of-two pieces, ``triton_pieces``): the row held as its
    pieces, not padded. ``l1_hints`` (the forward without bands): in column chunks of one row per program
    (``triton_two_pass``) two passes, the first loading with L1's ``evict_last`` hint and the second
    ``evict_first``, the row length a compile-time constant; a resident row's loads (x, residual, weight) all
    ``evict_last``. ``n_const`` (a row held whole, without bands or pieces; the forward's and the backward's): the
    row length a compile-time constant (one compile per N; the mask then only rows'). ``reload_weight`` (the
    resident backward, not the pieces): the weight loaded for every row block (an L1 hit) instead of held in registers,
    and dweight's term added before the row's sum (fewer registers live across it; the same bits)."""

    block_m: int
    block_n: int
    num_warps: int
    programs_per_sm: int = BWD_PROGRAMS_PER_SM
    rowdot_block_n: int = CHUNK_N
    rowdot_warps: int = _warps(CHUNK_N, 512)
    one_program_elems: int = ONE_PROGRAM_ELEMS
    lag: int = 0
    groups: int = 1
    prefetch: bool = False
    pieces: bool = False
    l1_hints: bool = False
    n_const: bool = False
    reload_weight: bool = False

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "num_warps", "rowdot_block_n", "rowdot_warps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 1, got {v!r}")
        if not isinstance(self.programs_per_sm, int) or self.programs_per_sm < 1:
            raise ValueError(f"programs_per_sm must be an int >= 1, got {self.programs_per_sm!r}")
        if not isinstance(self.one_program_elems, int) or self.one_program_elems < 0:
            raise ValueError(f"one_program_elems must be an int >= 0, got {self.one_program_elems!r}")
        if isinstance(self.lag, bool) or not isinstance(self.lag, int) or self.lag < 0:
            raise ValueError(f"lag must be an int >= 0, got {self.lag!r}")
        if isinstance(self.groups, bool) or not isinstance(self.groups, int) or self.groups < 1:
            raise ValueError(f"groups must be an int >= 1, got {self.groups!r}")
        for flag in ("prefetch", "pieces", "l1_hints", "n_const", "reload_weight"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be a bool, got {getattr(self, flag)!r}")
        if self.l1_hints and (self.lag or self.pieces):
            raise ValueError(f"l1_hints is an option of the forward without bands (lag=0, no pieces), got {self}")
        if self.n_const and (self.lag or self.pieces):
            raise ValueError(f"n_const is an option of rows held whole without bands or pieces (lag=0, no pieces), "
                             f"got {self}")
        if self.reload_weight and (self.lag or self.pieces or self.l1_hints):
            raise ValueError(f"reload_weight is an option of the resident backward (lag=0, no pieces, no l1_hints), "
                             f"got {self}")

    def chunked(self, n: int) -> bool:
        return self.block_n < n


def bands_config(n: int, sms: int, *, backward: bool, min_n: int | None = None, fused: bool = False) -> Config | None:
    """The band config for rows of ``n`` columns on a GPU of ``sms`` SMs from the Pallas band tables and grid
    (``band_tables.band_grid``; their prefetch for the backward, and for the plain forward, not the ``fused`` add's,
    up to ``FWD_BANDS_PREFETCH_MAX_N`` columns); None where rows take no bands: shorter than ``min_n`` (default
    ``BANDS_MIN_N`` / ``FWD_BANDS_MIN_N``; the bench passes 0 to time bands where the heuristic does not take them),
    or more than ``band_tables.BANDS_MAX_PER_SM`` bands per SM."""
    if min_n is None:
        min_n = BANDS_MIN_N if backward else FWD_BANDS_MIN_N
    grid = band_tables.band_grid(n, sms, backward=backward, min_cols=min_n)
    if grid is None:
        return None
    (cols, rows, warps, lag, prefetch, _), groups = grid
    prefetch = prefetch and (backward or (not fused and n <= FWD_BANDS_PREFETCH_MAX_N))
    return Config(rows, cols, warps, lag=lag, groups=groups, prefetch=prefetch)


@functools.cache
def forward_config(n: int, sms: int = 132, itemsize: int = 2, low: bool = True, m: int = 0,
                   fused: bool = False, model: str = "") -> Config:
    """The Pallas kernels' two-pass tile (``pallas_config.two_pass_tile``, ``l1_hints``) for ``m`` 16-bit rows
    (``itemsize``) of its lengths: its first (chunk, warps) where y's product is in the row dtype (``low``:
    ``triton_product.output_in_dtype``), else the float32 product's for ``m`` rows (on the GPU ``model``, e.g.
    "h200", its per-model entries, the plain forward's apart from the ``fused`` add's); 16-bit rows of exactly
    ``FWD_RESIDENT_BY_MODEL``'s widths on that ``model`` its tile (the fused add's too); ``FWD_RESIDENT``'s tile for
    full rows of its lengths (the ``fused`` add's forward ``FWD_ADD_RESIDENT``'s where it has one; the plain forward's
    row length a compile-time constant at rows of exactly ``FWD_N_CONST``'s), else one warp per 1024 tile elements
    in the one-pass forward (4 × 16-byte loads per thread for 16-bit dtypes; at most 16 warps), one per 512 over
    column chunks (more loads in flight) for rows beyond ``FWD_RESIDENT_MAX_N``; from ``FWD_BANDS_MIN_N`` columns
    bands for a GPU of ``sms`` SMs (the launcher uses them for float32 compute only). Resident rows take the Pallas
    kernels' L1 hints (``l1_hints.resident``)."""
    if (bands := bands_config(n, sms, backward=False, fused=fused)) is not None:
        return bands
    if tile := pallas_config.two_pass_tile(n, itemsize, low, m, sms, fused=fused, model=model):
        return Config(1, *tile, l1_hints=True)
    if itemsize == 2 and (tile := FWD_RESIDENT_BY_MODEL.get(model, {}).get(n)):
        block_m, warps, n_const = tile
        return Config(block_m, next_pow2(n), warps, l1_hints=l1_hints.resident(next_pow2(n)), n_const=n_const)
    if n <= FWD_RESIDENT_MAX_N:
        block_n = next_pow2(n)
        hints = l1_hints.resident(block_n)
        table = {**FWD_RESIDENT, **FWD_ADD_RESIDENT} if fused else FWD_RESIDENT
        if block_n in table and pallas_config.full_row(n):
            block_m, warps = table[block_n]
            n_const = not fused and block_n in FWD_N_CONST and n == block_n  # no column masked: run-time N's bits
            return Config(block_m, block_n, warps, l1_hints=hints, n_const=n_const)
        block_m = max(1, min(64, TILE_ELEMS // block_n))
        return Config(block_m, block_n, _warps(block_m * block_n, 1024), l1_hints=hints)
    return chunked_forward_config()


def chunked_forward_config() -> Config:
    """The long-row forward in column chunks of ``CHUNK_N`` (x read twice)."""
    return Config(1, CHUNK_N, _warps(CHUNK_N, 512))


@functools.cache
def resident_low(n: int) -> bool:
    """Whether ``rms_norm``'s backward of rows of ``n`` columns holds them whole where g is one multiply in the row
    dtype (``BWD_RESIDENT_LOW``: full rows of its padded lengths)."""
    return next_pow2(n) in BWD_RESIDENT_LOW and pallas_config.full_row(n)


def backward_config(n: int, sms: int = 132, fused: bool = False, low: bool = False, m: int = 0,
                    itemsize: int = 2, model: str = "") -> Config:
    """``_backward_config`` for a backward of ``m`` rows (0: few) of ``itemsize``-byte values on the GPU ``model``
    (e.g. "h200"): N a compile-time constant in ``rms_norm``'s backward (not ``fused``) of full rows of
    ``BWD_N_CONST``'s lengths, up to its rows (the cache's key takes that, not ``m``, so that varying batch sizes do
    not grow it)."""
    return _backward_config(n, sms, fused, low, not fused and n in BWD_N_CONST and m <= (BWD_N_CONST[n] or m),
                            itemsize == 2, model)


@functools.cache
def _backward_config(n: int, sms: int, fused: bool, low: bool, n_const: bool, half: bool = True,
                     model: str = "") -> Config:
    """The backward of 16-bit rows (``half``) of exactly ``BWD_RESIDENT_RELOAD``'s lengths held whole on one program
    per SM, reloading the weight; ``rms_norm``'s (not ``fused``) of full rows of ``BWD_RESIDENT_LOW``'s lengths held
    whole on one program per SM where g is one multiply in the row dtype (``low``: ``triton_product.grad_in_dtype``);
    ``BWD_PIECES``' widths held as their pieces (``rms_norm``'s backward, not ``fused``: on ``BWD_PIECES_PLAIN``'s
    warps and prefetch; the ``fused`` add's with the weight's product in the row dtype, ``low``, on
    ``BWD_PIECES_FUSED_LOW_BY_MODEL``'s tile for ``model``); one warp per 512 tile elements (x, dy and a dweight
    partial are live; per 1024 up to ``BWD_FEW_WARPS_MAX_N`` columns), the next row block prefetched for
    ``BWD_PREFETCH_N`` (16-bit per-head rows: ``BWD_HEADS``' warps and prefetch); long rows in chunks of
    ``BWD_CHUNK_N`` after a row-dot pass over chunks of ``CHUNK_N``; from ``BANDS_MIN_N`` columns bands for a GPU of
    ``sms`` SMs (the launcher uses them for float32 compute only). ``n_const``: rows held whole (not as pieces)
    compile with N a compile-time constant."""
    if half and n in BWD_RESIDENT_RELOAD:
        block_m, warps = BWD_RESIDENT_RELOAD[n]
        return Config(block_m, n, warps, programs_per_sm=1, n_const=True, reload_weight=True)
    if low and not fused and resident_low(n):
        block_m, warps = BWD_RESIDENT_LOW[next_pow2(n)]
        return Config(block_m, next_pow2(n), warps, programs_per_sm=1, n_const=n_const)
    if (bands := bands_config(n, sms, backward=True)) is not None:
        return bands
    if n in BWD_PIECES:
        warps, per_sm, prefetch = BWD_PIECES[n]
        if not fused and n in BWD_PIECES_PLAIN:
            warps, prefetch = BWD_PIECES_PLAIN[n]
        elif fused and low and n in (by_model := BWD_PIECES_FUSED_LOW_BY_MODEL.get(model, {})):
            warps, per_sm, prefetch = by_model[n]
        return Config(1, next_pow2(n), warps, programs_per_sm=per_sm, prefetch=prefetch, pieces=True)
    if n <= FUSED_MAX_N:
        block_n = next_pow2(n)
        block_m = max(1, min(64, TILE_ELEMS // block_n))
        lo, hi = BWD_PREFETCH_N
        per_warp = 1024 if lo <= block_n <= BWD_FEW_WARPS_MAX_N else 512
        tile = (_warps(block_m * block_n, per_warp), lo <= block_n <= hi)
        warps, prefetch = BWD_HEADS.get(block_n, tile) if half else tile
        return Config(block_m, block_n, warps, prefetch=prefetch,
                      programs_per_sm=1 if block_n == hi else BWD_PROGRAMS_PER_SM, n_const=n_const)
    return chunked_backward_config()


def chunked_backward_config() -> Config:
    """The long-row backward in column chunks of ``BWD_CHUNK_N`` after a row-dot pass (5 passes over memory)."""
    return Config(1, BWD_CHUNK_N, _warps(BWD_CHUNK_N, 512))
