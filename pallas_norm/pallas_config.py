"""Tiling of the Pallas kernels: a frozen ``Config`` per kernel launch, and the heuristics that pick one per shape.

``rms_norm(..., config=Config(...), bwd_config=Config(...))`` forces a config (tests cover every code path with
small ones; ``python -m bench sweep`` times alternatives); ``None`` takes the heuristic. Configs are hashable
and part of the cache keys of the JAX functions, so each config compiles once.
"""

from __future__ import annotations

import dataclasses

from . import backend, l1_hints
from .band_tables import BANDS_MIN_COLS, band_grid
from .ffi_tables import (BWD_FFI_HELD, BWD_FFI_MIN_ROWS_PER_SM, BWD_FFI_PIECES, BWD_FFI_PIECES_PLAIN,  # noqa: F401
                         BWD_FFI_RESIDENT, FWD_FFI_FEW_ROWS, FWD_FFI_RESIDENT, FWD_FFI_TWO_PASS, two_pass_tile)

# Rows whose padded length is at most this many elements stay in registers (one load, one store per element);
# longer rows are walked in column chunks by a persistent grid.
MAX_RESIDENT_COLS = 16384
FWD_BANDS_MIN_COLS = MAX_RESIDENT_COLS + 1  # the forward takes column bands beyond (band_tables.py)
MAX_BLOCK_ROWS = 1024
REGISTERS_PER_SM = 65536  # 32-bit registers of an SM (Volta to Hopper): ``register_cap``
THREADS_PER_SM = 2048  # resident threads of an SM (Volta to Hopper): ``register_cap``
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


def next_pow2(v: int) -> int:
    return 1 if v <= 1 else 1 << (v - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pieces_of(n: int) -> list[int]:
    """The power-of-two pieces of a row of ``n`` columns, largest first (its binary digits: 2304 → [2048, 256])."""
    return [1 << b for b in range(n.bit_length() - 1, -1, -1) if n >> b & 1]


def full_row(n: int) -> bool:
    """Whether a row of ``n`` columns fills more than ``PADDED_FILL`` of its padded length (the resident forward's
    tables hold such rows; both stacks' heuristics and ``auto``'s backward choice ask this)."""
    return n > PADDED_FILL * next_pow2(n)


def ffi_forward(n: int) -> bool:
    """Whether the forward (plain or fused add) of rows of ``n`` columns runs held in registers and launched by
    jaxlib's Triton call (``FWD_FFI_RESIDENT``: full rows of those padded lengths, where ``triton_ffi.available()``)."""
    return _ffi(n, FWD_FFI_RESIDENT)


def ffi_few_rows(m: int, n: int) -> bool:
    """Whether the resident forward (plain or fused add) of ``m`` rows of ``n`` columns is launched by jaxlib's Triton
    call on its XLA tile (``FWD_FFI_FEW_ROWS``: full rows of those padded lengths, at most that many rows per SM)."""
    per_sm = FWD_FFI_FEW_ROWS.get(next_pow2(n))
    return per_sm is not None and full_row(n) and _available() and m <= per_sm * backend.num_sms()


def ffi_backward(n: int) -> bool:
    """Whether the resident backward (plain or fused add) of rows of ``n`` columns is launched by jaxlib's Triton call
    (``BWD_FFI_RESIDENT``: full rows of those padded lengths not held as pieces; ``BWD_FFI_PIECES``: rows held as
    pieces of those widths; where ``triton_ffi.available()``)."""
    if n in BWD_PIECES:
        return n in BWD_FFI_PIECES and _available()
    return _ffi(n, BWD_FFI_RESIDENT)


def _ffi(n: int, padded_lengths) -> bool:
    return full_row(n) and next_pow2(n) in padded_lengths and _available()


def _available() -> bool:
    from . import triton_ffi

    return triton_ffi.available()


def one_program(m: int, n: int) -> bool:
    """Whether an ``(m, n)`` backward is small enough for one program (``ONE_PROGRAM_ELEMS``)."""
    return m * n <= ONE_PROGRAM_ELEMS


def register_cap(config: Config) -> int | None:
    """The most registers per thread that let a persistent grid's programs (``config.programs``; None for a grid of
    row blocks) all be resident at once: ``REGISTERS_PER_SM`` shared by the ⌈programs / SMs⌉ programs of
    ``num_warps`` warps an SM gets, in whole steps of 8, at most 255. Given to the assembler where jaxlib launches a
    kernel (``triton_ffi``): it assigns what the code wants otherwise, and the fused add's pieces backward at 2304
    columns took 135 registers on 4 warps, so 3 of its 4 programs per SM fitted and the grid ran a second wave.
    None too where an SM's share exceeds ``THREADS_PER_SM`` (no register count lets it fit; a cap would be 0)."""
    if config.programs is None:
        return None
    threads = cdiv(config.programs, backend.num_sms()) * config.num_warps * 32
    return None if threads > THREADS_PER_SM else min(255, REGISTERS_PER_SM // threads // 8 * 8)


def _pow2(name: str, v: object, limit: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v & (v - 1) or v > limit:
        raise ValueError(f"{name} must be a power of two in [1, {limit}], got {v!r}")


@dataclasses.dataclass(frozen=True)
class Config:
    """One kernel launch's tiling.

    ``block_rows`` rows per program; ``block_cols`` the tile width: the padded row when it is at least N (the row
    stays in registers), else the column chunk walked along the row; ``num_warps``/``num_stages`` Triton's launch
    settings; ``programs`` the persistent grid of the backward (one float32 ``dweight`` partial each) and of the
    long-row forward (``None``: the heuristic's); ``prefetch``: loops load their next tile before using the current
    one (two tiles live per loop, the next one's loads in flight during the current one's math); ``reload_weight``:
    the backward loads the weight for every row block (an L1 hit) instead of holding it in registers and adds
    dweight's term before the row's sum (fewer live registers for long resident rows; the same bits); ``lag``
    (chunked rows; 0: off): programs own column bands of ``block_cols`` and exchange row sums through global memory,
    a block finished ``lag`` row blocks after its sums were posted (``bands.py``: x and dy read from memory once);
    ``programs`` is then the band count times the row groups (``programs // chunks(n)``; group g walks row blocks g,
    g + groups, ...), and a group's bands must be resident at once to run at speed; ``carry`` (bands): the last
    ``lag`` blocks' tiles stay in registers until they are finished instead of being loaded again (from L1 or L2: no
    second read, more live registers); ``ffi_launch``
    (the resident forward and backward): compiled by the ``triton`` package and launched by jaxlib's Triton call
    instead of by XLA (``triton_ffi``: the driver's L1 carveout; GPU only, ignored by the interpreter), a
    persistent grid's kernel held to the registers that let its ``programs`` fit at once (``register_cap``: a tile
    wanting more spills); ``l1_hints`` (the forward without bands): in column chunks, the first pass loads with
    L1's ``evict_last`` hint and the second with ``evict_first``, so the second read hits L1 where the carveout
    leaves room (jaxlib's launch); a resident row's loads (x, residual, weight) all ``evict_last``.
    """

    block_rows: int
    block_cols: int
    num_warps: int
    num_stages: int | None = None
    programs: int | None = None
    prefetch: bool = False
    reload_weight: bool = False
    lag: int = 0
    carry: bool = False
    ffi_launch: bool = False
    pieces: bool = False
    l1_hints: bool = False

    def __post_init__(self) -> None:
        _pow2("block_rows", self.block_rows, MAX_BLOCK_ROWS)
        _pow2("block_cols", self.block_cols, 1 << 20)
        _pow2("num_warps", self.num_warps, 32)
        if self.num_stages is not None and (not isinstance(self.num_stages, int) or self.num_stages < 1):
            raise ValueError(f"num_stages must be None or an int >= 1, got {self.num_stages!r}")
        if self.programs is not None and (not isinstance(self.programs, int) or self.programs < 1):
            raise ValueError(f"programs must be None or an int >= 1, got {self.programs!r}")
        for flag in ("prefetch", "reload_weight", "carry", "ffi_launch", "pieces", "l1_hints"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be a bool, got {getattr(self, flag)!r}")
        if isinstance(self.lag, bool) or not isinstance(self.lag, int) or self.lag < 0:
            raise ValueError(f"lag must be an int >= 0, got {self.lag!r}")

    def chunks(self, n: int) -> int:
        """Column chunks per row of length ``n`` (1: the row is resident)."""
        return cdiv(n, self.block_cols)

    def resident(self, n: int) -> bool:
        return self.chunks(n) == 1


def heuristic(m: int, n: int, *, backward: bool, fused: bool = False, itemsize: int = 2,
              product_in_dtype: bool = True) -> Config:
    """The default config for an ``(m, n)`` forward (or ``backward``), from the tables above; ``fused``: the fused
    add's (its forward ``FWD_ADD_RESIDENT``; ``False``: the plain backward may take ``BWD_FFI_PIECES_PLAIN``);
    ``itemsize`` and ``product_in_dtype`` (``kernels.product_in_dtype``) pick ``FWD_FFI_TWO_PASS``' tile; the resident
    forward's L1 hints follow ``l1_hints.resident``."""
    n_pad = next_pow2(n)
    if not backward and _available() and (tile := two_pass_tile(n, itemsize, product_in_dtype, m,
                                                                 backend.num_sms())):  # a row per program
        cols, warps = tile
        return fit(Config(1, cols, warps, programs=max(m, 1), ffi_launch=True, l1_hints=True), m, n, backward=False)
    hints = not backward and l1_hints.resident(n_pad)  # the resident forward's
    if not backward and ffi_forward(n):
        block_rows, warps = FWD_FFI_RESIDENT[n_pad]
        return fit(Config(block_rows, n_pad, warps, ffi_launch=True, l1_hints=hints), m, n, backward=False)
    held = backward and itemsize == 2 and n in BWD_FFI_HELD and not one_program(m, n) and _available()
    banded = None if held else bands_config(m, n, backward=backward)
    if banded is not None:
        return banded
    if n_pad > MAX_RESIDENT_COLS:
        cols, warps, per_sm, prefetch = BWD_CHUNKED if backward else FWD_CHUNKED
        programs = _grid(per_sm, cdiv(n, cols), backward)
        return fit(Config(1, cols, warps, programs=programs, prefetch=prefetch), m, n, backward=backward)
    rows = next_pow2(max(m, 1))
    if not backward:
        padded = not full_row(n)
        table = {**FWD_RESIDENT, **FWD_ADD_RESIDENT} if fused else FWD_RESIDENT  # per-head widths: the plain's
        if not padded and n_pad in table:
            block_rows, warps = table[n_pad]
        else:
            block_rows = min(max(1, TARGET_ELEMS // (2 if padded else 1) // n_pad), MAX_BLOCK_ROWS)
            warps = min(16, max(1, block_rows * n_pad // FWD_ELEMS_PER_WARP))
        return fit(Config(min(block_rows, rows), n_pad, warps, ffi_launch=ffi_few_rows(m, n), l1_hints=hints), m, n,
                   backward=False)
    few = m < BWD_FFI_MIN_ROWS_PER_SM.get(n_pad, 0) * backend.num_sms()  # XLA's launch costs less there
    pieces, ffi = n in BWD_PIECES, held or (ffi_backward(n) and not few)
    if pieces:
        (warps, per_sm, prefetch), block_rows, reload_weight = (BWD_FFI_PIECES if ffi else BWD_PIECES)[n], 1, False
    else:
        elems, warps, per_sm, prefetch, reload_weight = BWD_RESIDENT[n_pad]
        block_rows = min(max(1, elems // n_pad), MAX_BLOCK_ROWS, rows)
    programs = 1 if one_program(m, n) else _grid(per_sm, 1, True)
    if not pieces:  # as many programs as keep the most row blocks per program (BWD_RESIDENT's note)
        programs = balanced(programs, cdiv(max(m, 1), block_rows))
    if pieces and ffi and not fused and n in BWD_FFI_PIECES_PLAIN:
        plain_warps, plain_prefetch, most = BWD_FFI_PIECES_PLAIN[n]
        if most is None or cdiv(max(m, 1), programs) <= most:
            warps, prefetch = plain_warps, plain_prefetch
    return fit(Config(block_rows, n_pad, warps, programs=programs, prefetch=prefetch, reload_weight=reload_weight,
                      pieces=pieces, ffi_launch=ffi), m, n, backward=True)


def bands_config(m: int, n: int, *, backward: bool, min_cols: int | None = None) -> Config | None:
    """The heuristic's band config for an ``(m, n)`` launch (``band_tables.BANDS``/``FWD_BANDS``), or None where rows
    are shorter than ``min_cols`` (default ``BANDS_MIN_COLS`` / ``FWD_BANDS_MIN_COLS``; the bench passes 0 to time
    bands where the heuristic does not take them), have more than ``BANDS_MAX_PER_SM`` bands per SM, or the backward
    is small enough for one program (``one_program``: one launch storing dweight)."""
    if min_cols is None:
        min_cols = BANDS_MIN_COLS if backward else FWD_BANDS_MIN_COLS
    grid = band_grid(n, backend.num_sms(), backward=backward, min_cols=min_cols)
    if grid is None or (backward and one_program(m, n)):
        return None
    (cols, rows, warps, lag, prefetch, _), groups = grid
    return fit(Config(rows, cols, warps, programs=cdiv(n, cols) * groups, prefetch=prefetch, lag=lag), m, n,
               backward=backward)


def balanced(programs: int, blocks: int) -> int:
    """The fewest programs that give none more than ``programs`` would of ``blocks`` row blocks (each program walks
    blocks p, p + P, ...): every program then takes the same count, or one fewer (4096 rows of 2-row blocks on 132
    programs: 16 or 15 each; on 128, 16 each)."""
    return cdiv(blocks, cdiv(blocks, max(1, programs)))


def _grid(per_sm: int, chunks: int, backward: bool) -> int:
    """A persistent grid of ``per_sm`` programs per SM; the backward's are shared among a row's column chunks."""
    return max(1, per_sm * backend.num_sms() // (chunks if backward else 1))


def fit(config: Config | None, m: int, n: int, *, backward: bool, fused: bool = False, itemsize: int = 2,
        product_in_dtype: bool = True) -> Config:
    """``config`` (the heuristic's when None, given ``fused``, ``itemsize`` and ``product_in_dtype``) for an
    ``(m, n)`` launch: ``block_cols`` at most N's padded length and, where a persistent grid runs (the backward; the
    long-row forward), a concrete ``programs`` between 1 and the number of row blocks (None where it does not)."""
    if config is None:
        return heuristic(m, n, backward=backward, fused=fused, itemsize=itemsize, product_in_dtype=product_in_dtype)
    if config.ffi_launch and (config.lag or (backward and next_pow2(n) > config.block_cols)):
        raise ValueError(f"ffi_launch is an option of the forward of rows without bands (lag=0) and of the backward "
                         f"of rows held whole (block_cols >= the padded row, {next_pow2(n)} here), got {config} for "
                         f"the {'backward' if backward else 'forward'}")
    config = dataclasses.replace(config, block_cols=min(config.block_cols, next_pow2(n)))
    chunks = config.chunks(n)
    if config.l1_hints and (backward or config.lag):
        raise ValueError(f"l1_hints is an option of the forward without bands (lag=0), got {config} for the "
                         f"{'backward' if backward else 'forward'}")
    if config.pieces and not (backward and chunks == 1):
        raise ValueError(f"pieces is an option of the backward of rows held whole (block_cols >= the padded row, "
                         f"{next_pow2(n)} here), got {config} for the {'backward' if backward else 'forward'}")
    if config.lag and chunks == 1:  # no bands: a resident row
        config = dataclasses.replace(config, lag=0)
    if config.lag:  # a grid of bands × row groups (each group at least one row block)
        groups = max(1, min((config.programs or chunks) // chunks, cdiv(max(m, 1), config.block_rows)))
        return dataclasses.replace(config, programs=chunks * groups)
    if not backward and chunks == 1:
        return dataclasses.replace(config, programs=None)
    programs = config.programs
    if programs is None:  # a forced config without a grid size: two programs per SM
        programs = _grid(2, chunks, backward)
    return dataclasses.replace(config, programs=max(1, min(programs, cdiv(max(m, 1), config.block_rows))))
