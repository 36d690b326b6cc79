"""Tiling plans: how many rows and columns each Pallas program handles, and how many programs run."""

from __future__ import annotations

import dataclasses

from . import backend

# Rows whose padded length is at most this many elements stay in registers (one load, one store per element);
# longer rows are processed in column chunks of CHUNK_COLS elements.
MAX_RESIDENT_COLS = 16384
CHUNK_COLS = 4096
# Elements one program holds: rows per program = TARGET_ELEMS / padded row length (at least 1). The backward
# holds x, dy and a dweight partial per element, so it takes fewer rows and more warps (H100 sweep at
# 32768×4096 bf16, bench/results/pallas_h100.md: forward 2 rows × 8 warps, backward 1 row × 16 warps).
TARGET_ELEMS = 8192
TARGET_ELEMS_BWD = 4096
ELEMS_PER_WARP = {False: 1024, True: 256}
MAX_BLOCK_ROWS = 1024


def next_pow2(v: int) -> int:
    return 1 if v <= 1 else 1 << (v - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class Plan:
    """One kernel launch's tiling.

    ``block_cols`` is the padded row length when ``chunks == 1`` (row resident in registers), else the chunk
    width; ``programs`` is the persistent backward grid (dweight partial sums, one per program).
    """

    block_rows: int
    block_cols: int
    chunks: int
    num_warps: int
    programs: int

    @property
    def resident(self) -> bool:
        return self.chunks == 1


def make_plan(
    m: int,
    n: int,
    *,
    block_rows: int | None = None,
    block_cols: int | None = None,
    programs: int | None = None,
    num_warps: int | None = None,
    backward: bool = False,
) -> Plan:
    """Default plan for an ``(m, n)`` forward (or ``backward``); any field can be forced (tests use this to
    cover every path)."""
    n_pad = next_pow2(n)
    if block_cols is None:
        block_cols = n_pad if n_pad <= MAX_RESIDENT_COLS else CHUNK_COLS
    block_cols = next_pow2(min(block_cols, n_pad))
    chunks = cdiv(n, block_cols)
    if block_rows is None:
        target = TARGET_ELEMS_BWD if backward else TARGET_ELEMS
        block_rows = max(1, target // block_cols) if chunks == 1 else 1
        block_rows = min(block_rows, MAX_BLOCK_ROWS, next_pow2(max(m, 1)))
    if num_warps is None:
        num_warps = min(16, max(1, block_rows * block_cols // ELEMS_PER_WARP[backward]))
    row_blocks = cdiv(max(m, 1), block_rows)
    if programs is None:
        sms = backend.num_sms()
        programs = 2 * sms if chunks == 1 else max(1, 2 * sms // chunks)
    programs = max(1, min(programs, row_blocks))
    return Plan(block_rows, block_cols, chunks, num_warps, programs)
