"""Tiling of the Pallas kernels: a frozen ``Config`` per kernel launch, and the heuristics that pick one per shape.

``rms_norm(..., config=Config(...), bwd_config=Config(...))`` forces a config (tests cover every code path with
small ones; ``python -m bench sweep`` times alternatives); ``None`` takes the heuristic. Configs are hashable
and part of the cache keys of the JAX functions, so each config compiles once.
"""

from __future__ import annotations

import dataclasses

from . import backend

# Rows whose padded length is at most this many elements stay in registers (one load, one store per element);
# longer rows are processed in column chunks of CHUNK_COLS elements.
MAX_RESIDENT_COLS = 16384
CHUNK_COLS = 4096
# Elements one program holds: rows per program = TARGET_ELEMS / padded row length (at least 1). The backward
# holds x, dy and a dweight partial per element, so it takes fewer rows and more warps (H100 sweep at
# 32768×4096 bf16, bench/results/pallas_h100_sweep.md: forward 2 rows × 8 warps, backward 1 row × 16 warps).
TARGET_ELEMS = {False: 8192, True: 4096}
ELEMS_PER_WARP = {False: 1024, True: 256}
MAX_BLOCK_ROWS = 1024


def next_pow2(v: int) -> int:
    return 1 if v <= 1 else 1 << (v - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(name: str, v: object, limit: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v & (v - 1) or v > limit:
        raise ValueError(f"{name} must be a power of two in [1, {limit}], got {v!r}")


@dataclasses.dataclass(frozen=True)
class Config:
    """One kernel launch's tiling.

    ``block_rows`` rows per program; ``block_cols`` the tile width: the padded row when it is at least N (the row
    stays in registers), else the column chunk walked along the row; ``num_warps``/``num_stages`` Triton's launch
    settings; ``programs`` the backward's persistent grid (one float32 ``dweight`` partial each; ``None``: the
    heuristic's).
    """

    block_rows: int
    block_cols: int
    num_warps: int
    num_stages: int | None = None
    programs: int | None = None

    def __post_init__(self) -> None:
        _pow2("block_rows", self.block_rows, MAX_BLOCK_ROWS)
        _pow2("block_cols", self.block_cols, 1 << 20)
        _pow2("num_warps", self.num_warps, 32)
        if self.num_stages is not None and (not isinstance(self.num_stages, int) or self.num_stages < 1):
            raise ValueError(f"num_stages must be None or an int >= 1, got {self.num_stages!r}")
        if self.programs is not None and (not isinstance(self.programs, int) or self.programs < 1):
            raise ValueError(f"programs must be None or an int >= 1, got {self.programs!r}")

    def chunks(self, n: int) -> int:
        """Column chunks per row of length ``n`` (1: the row is resident)."""
        return cdiv(n, self.block_cols)

    def resident(self, n: int) -> bool:
        return self.chunks(n) == 1


def heuristic(m: int, n: int, *, backward: bool) -> Config:
    """The default config for an ``(m, n)`` forward (or ``backward``)."""
    n_pad = next_pow2(n)
    block_cols = n_pad if n_pad <= MAX_RESIDENT_COLS else CHUNK_COLS
    if block_cols >= n:
        block_rows = min(max(1, TARGET_ELEMS[backward] // block_cols), MAX_BLOCK_ROWS, next_pow2(max(m, 1)))
    else:
        block_rows = 1
    num_warps = min(16, next_pow2(max(1, block_rows * block_cols // ELEMS_PER_WARP[backward])))
    return fit(Config(block_rows, block_cols, num_warps), m, n, backward=backward)


def fit(config: Config | None, m: int, n: int, *, backward: bool) -> Config:
    """``config`` (the heuristic's when None) for an ``(m, n)`` launch: ``block_cols`` at most N's padded length
    and, for the backward, a concrete ``programs`` between 1 and the number of row blocks."""
    if config is None:
        return heuristic(m, n, backward=backward)
    config = dataclasses.replace(config, block_cols=min(config.block_cols, next_pow2(n)))
    if not backward:
        return config
    programs = config.programs
    if programs is None:
        sms, chunks = backend.num_sms(), config.chunks(n)
        programs = 2 * sms if chunks == 1 else max(1, 2 * sms // chunks)
    return dataclasses.replace(config, programs=max(1, min(programs, cdiv(max(m, 1), config.block_rows))))
