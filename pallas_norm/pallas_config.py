"""Tiling of the Pallas kernels: a frozen ``Config`` per kernel launch, and the heuristics that pick one per shape.

``rms_norm(..., config=Config(...), bwd_config=Config(...))`` forces a config (tests cover every code path with
small ones; ``python -m bench sweep`` times alternatives); ``None`` takes the heuristic. Configs are hashable
and part of the cache keys of the JAX functions, so each config compiles once.
"""

from __future__ import annotations

import dataclasses

from . import backend, l1_hints
from .band_tables import BANDS_MIN_COLS, band_grid
from .ffi_tables import (BWD_FFI_HELD, BWD_FFI_MIN_ROWS_PER_SM, BWD_FFI_PIECES, BWD_FFI_PIECES_BY_MODEL,  # noqa: F401
                         BWD_FFI_PIECES_PLAIN, BWD_FFI_PIECES_PLAIN_BY_MODEL, BWD_FFI_RESIDENT, FWD_FFI_ALL_ROWS,
                         FWD_FFI_FEW_ROWS, FWD_FFI_EXACT_BY_MODEL, FWD_FFI_RESIDENT, FWD_FFI_RESIDENT_BY_MODEL,
                         FWD_FFI_TWO_PASS, FWD_FFI_XLA_TILE_BY_MODEL, two_pass_tile)
from .tile_tables import (BWD_CHUNKED, BWD_PIECES, BWD_RESIDENT, FWD_ADD_RESIDENT, FWD_CHUNKED,  # noqa: F401
                          FWD_ELEMS_PER_WARP, FWD_ONE_WARP, FWD_RESIDENT, ONE_PROGRAM_ELEMS, PADDED_FILL, TARGET_ELEMS)

# Rows whose padded length is at most this many elements stay in registers (one load, one store per element);
# longer rows are walked in column chunks by a persistent grid.
MAX_RESIDENT_COLS = 16384
FWD_BANDS_MIN_COLS = MAX_RESIDENT_COLS + 1  # the forward takes column bands beyond (band_tables.py)
MAX_BLOCK_ROWS = 1024
REGISTERS_PER_SM = 65536  # 32-bit registers of an SM (Volta to Hopper): ``register_cap``
THREADS_PER_SM = 2048  # resident threads of an SM (Volta to Hopper): ``register_cap``


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


def this_model(table: dict) -> dict | frozenset:
    """A per-model table's entry for this GPU's model (``backend.gpu_model()``); empty where it names none."""
    return table.get(backend.gpu_model(), {})


def model_entry(by_model: dict, table: dict, key: int):
    """``table[key]`` unless ``by_model`` (a per-model table of the same entries) names another for this GPU's model
    (``this_model``); None where neither holds ``key``."""
    return this_model(by_model).get(key, table.get(key))


def from_rows_per_sm(m: int, least: int | None) -> bool:
    """Whether ``m`` rows are at least ``least`` rows per SM of this GPU (None: never): the per-model tables' bound."""
    return least is not None and m >= least * backend.num_sms()


def ffi_forward(n: int) -> bool:
    """Whether the forward (plain or fused add) of rows of ``n`` columns runs held in registers and launched by
    jaxlib's Triton call (``FWD_FFI_RESIDENT``: full rows of those padded lengths, their tiles
    ``FWD_FFI_RESIDENT_BY_MODEL``'s on the GPU model it names; and ``FWD_FFI_EXACT_BY_MODEL``'s lengths on its tiles
    on the GPU model it names; where ``triton_ffi.available()``; the heuristic leaves ``FWD_ONE_WARP``'s rows)."""
    return _ffi(n, FWD_FFI_RESIDENT) or (n in this_model(FWD_FFI_EXACT_BY_MODEL) and _available())


def ffi_xla_tile(m: int, n: int, itemsize: int = 2, product_in_dtype: bool = True) -> bool:
    """Whether the resident forward (plain or fused add) of ``m`` rows of ``n`` ``itemsize``-byte columns is launched
    by jaxlib's Triton call on its XLA tile: ``FWD_FFI_FEW_ROWS`` (full rows of those padded lengths, at most that many
    rows per SM), ``FWD_FFI_ALL_ROWS`` (rows of those padded lengths on the GPU model it names) or
    ``FWD_FFI_XLA_TILE_BY_MODEL`` (16-bit rows of those widths from its rows per SM for the weight's product in the
    row's dtype, ``product_in_dtype``, or in float32), where ``triton_ffi.available()``."""
    n_pad = next_pow2(n)
    few = n_pad in FWD_FFI_FEW_ROWS and full_row(n) and m <= FWD_FFI_FEW_ROWS[n_pad] * backend.num_sms()
    low, f32 = this_model(FWD_FFI_XLA_TILE_BY_MODEL).get(n, (None, None)) if itemsize == 2 else (None, None)
    many = from_rows_per_sm(m, low if product_in_dtype else f32)
    return (few or many or n_pad in this_model(FWD_FFI_ALL_ROWS)) and _available()


def one_warp_forward(m: int, n: int, itemsize: int = 2, product_in_dtype: bool = True) -> bool:
    """Whether the resident forward (plain and fused add alike) of ``m`` rows of ``n`` ``itemsize``-byte columns runs
    a row per one-warp program: ``FWD_ONE_WARP`` (16-bit rows of those widths, from that many rows per SM, on the GPU
    model it names), where the weight's product is taken in the row's dtype (``product_in_dtype``, Llama's casting;
    ``FWD_ONE_WARP``'s note: Gemma's float32 product made the plain forward slower)."""
    return from_rows_per_sm(m, this_model(FWD_ONE_WARP).get(n) if itemsize == 2 and product_in_dtype else None)


def ffi_backward(n: int, m: int | None = None) -> bool:
    """Whether the resident backward (plain or fused add) of rows of ``n`` columns is launched by jaxlib's Triton call
    (``BWD_FFI_RESIDENT``: full rows of those padded lengths not held as pieces, with ``m`` rows from
    ``BWD_FFI_MIN_ROWS_PER_SM``'s rows per SM where it names the length; ``BWD_FFI_PIECES``: rows held as pieces of
    those widths; where ``triton_ffi.available()``)."""
    if n in BWD_PIECES:
        return n in BWD_FFI_PIECES and _available()
    few = m is not None and m < BWD_FFI_MIN_ROWS_PER_SM.get(next_pow2(n), 0) * backend.num_sms()
    return not few and _ffi(n, BWD_FFI_RESIDENT)


def ffi_held(m: int, n: int, itemsize: int) -> bool:
    """Whether the backward (plain or fused add) of ``m`` rows of ``n`` ``itemsize``-byte columns is held whole on
    ``BWD_RESIDENT``'s tile launched by jaxlib's Triton call instead of column bands (``BWD_FFI_HELD``: 16-bit rows of
    exactly those lengths, more than one program's worth, where ``triton_ffi.available()``)."""
    return itemsize == 2 and n in BWD_FFI_HELD and not one_program(m, n) and _available()


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
    return None if config.programs is None else registers_per_thread(cdiv(config.programs, backend.num_sms()),
                                                                      config.num_warps)


def registers_per_thread(programs_per_sm: int, num_warps: int) -> int | None:
    """``REGISTERS_PER_SM`` shared by ``programs_per_sm`` programs of ``num_warps`` warps, in whole steps of 8, at most
    255; None where they exceed ``THREADS_PER_SM`` (``register_cap``; the Triton reference's persistent grids too)."""
    threads = programs_per_sm * num_warps * 32
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
    """The default config for an ``(m, n)`` forward (or ``backward``), from the tables (``tile_tables``,
    ``ffi_tables``, ``band_tables``); ``fused``: the fused add's (its forward ``FWD_ADD_RESIDENT``; ``False``: the
    plain backward may take ``BWD_FFI_PIECES_PLAIN``'s tile, ``BWD_FFI_PIECES_PLAIN_BY_MODEL``'s on the GPU model it
    names); ``itemsize`` and ``product_in_dtype`` (``kernels.product_in_dtype``) pick ``FWD_FFI_TWO_PASS``' tile
    (both also ``FWD_ONE_WARP``'s); the resident forward's L1 hints follow ``l1_hints.resident``."""
    n_pad = next_pow2(n)
    if not backward and _available() and (tile := two_pass_tile(n, itemsize, product_in_dtype, m, backend.num_sms(),
                                                                 fused=fused, model=backend.gpu_model())):
        cols, warps = tile  # a row per program
        return fit(Config(1, cols, warps, programs=max(m, 1), ffi_launch=True, l1_hints=True), m, n, backward=False)
    hints = not backward and l1_hints.resident(n_pad)  # the resident forward's
    rows = next_pow2(max(m, 1))
    if not backward and ffi_forward(n) and not one_warp_forward(m, n, itemsize, product_in_dtype):
        block_rows, warps = this_model(FWD_FFI_EXACT_BY_MODEL).get(n) or model_entry(FWD_FFI_RESIDENT_BY_MODEL,
                                                                                       FWD_FFI_RESIDENT, n_pad)
        return fit(Config(min(block_rows, rows), n_pad, warps, ffi_launch=True, l1_hints=hints), m, n, backward=False)
    held = backward and ffi_held(m, n, itemsize)
    banded = None if held else bands_config(m, n, backward=backward)
    if banded is not None:
        return banded
    if n_pad > MAX_RESIDENT_COLS:
        cols, warps, per_sm, prefetch = BWD_CHUNKED if backward else FWD_CHUNKED
        programs = _grid(per_sm, cdiv(n, cols), backward)
        return fit(Config(1, cols, warps, programs=programs, prefetch=prefetch), m, n, backward=backward)
    if not backward:
        padded = not full_row(n)
        table = {**FWD_RESIDENT, **FWD_ADD_RESIDENT} if fused else FWD_RESIDENT  # per-head widths: the plain's
        if not padded and n_pad in table:
            block_rows, warps = table[n_pad]
        else:
            block_rows = min(max(1, TARGET_ELEMS // (2 if padded else 1) // n_pad), MAX_BLOCK_ROWS)
            warps = min(16, max(1, block_rows * n_pad // FWD_ELEMS_PER_WARP))
        if one_warp_forward(m, n, itemsize, product_in_dtype):
            block_rows, warps = 1, 1
        ffi = ffi_xla_tile(m, n, itemsize, product_in_dtype)
        return fit(Config(min(block_rows, rows), n_pad, warps, ffi_launch=ffi, l1_hints=hints), m, n, backward=False)
    pieces, ffi = n in BWD_PIECES, held or ffi_backward(n, m)
    if pieces:
        tile = model_entry(BWD_FFI_PIECES_BY_MODEL, BWD_FFI_PIECES, n) if ffi else BWD_PIECES[n]
        (warps, per_sm, prefetch), block_rows, reload_weight = tile, 1, False
    else:
        elems, warps, per_sm, prefetch, reload_weight = BWD_RESIDENT[n_pad]
        block_rows = min(max(1, elems // n_pad), MAX_BLOCK_ROWS, rows)
    programs = 1 if one_program(m, n) else _grid(per_sm, 1, True)
    if not pieces:  # as many programs as keep the most row blocks per program (BWD_RESIDENT's note)
        programs = balanced(programs, cdiv(max(m, 1), block_rows))
    plain = model_entry(BWD_FFI_PIECES_PLAIN_BY_MODEL, BWD_FFI_PIECES_PLAIN, n)
    if pieces and ffi and not fused and plain:
        plain_warps, plain_prefetch, most = plain
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
