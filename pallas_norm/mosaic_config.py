"""Tiling of the Mosaic GPU kernels (``impl="mosaic"``): a frozen ``MosaicConfig`` per launch, its fitting to
a shape (shared memory, cluster, persistent grid) and the heuristic that picks one.

The Mosaic kernels stage whole rows in shared memory (TMA bulk copies), so ``x`` is read from memory once per
pass however long the row: a row longer than one SM's shared memory is split over a cluster of ``cluster`` CTAs
(each holds ``N / cluster`` columns; the sum of squares is exchanged through distributed shared memory). The
forward of rows one CTA holds in registers stages nothing (``direct``, ``DIRECT_MAX_N``).
"""

from __future__ import annotations

import dataclasses

from . import backend
from .pallas_config import cdiv, next_pow2, this_model

SMEM_BYTES = 227 * 1024  # usable shared memory per CTA (and per SM) on Hopper
SMEM_RESERVED = 4 * 1024  # barriers, the reduction scratch, the exchanged partial sums
MAX_CLUSTER = 16  # CTAs per cluster at most: 8 is the portable size, Hopper runs 16 (non-portable; Mosaic GPU's
# launches of clusters of 16 ran on the H100, 2026-11-24, and read 2048×131072 at 2.75 TB/s forward, 2.30 backward)
CLUSTERS = (1, 2, 4, 8, MAX_CLUSTER)
THREADS = 128  # one warpgroup per CTA
DW_REGS = 64  # float32 dweight accumulators per thread at most (the backward holds its columns' partials; the
# columns beyond ``DW_REGS · THREADS`` keep theirs in shared memory)
ALIGN = 128  # rows are padded to a multiple of this many elements (each CTA's share a multiple of it)


class Unsupported(ValueError):
    """A shape the Mosaic kernels cannot stage (a row whose share per CTA exceeds shared memory even on clusters of
    ``MAX_CLUSTER``)."""


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    """One Mosaic kernel launch.

    ``block_rows`` rows per TMA block (each staged whole, or its ``1/cluster`` share); ``stages`` blocks in
    shared memory at once (``stages - 1`` loads in flight while one block computes); ``cluster`` CTAs sharing
    each row (``CLUSTERS``; None: the fewest that fit); ``programs_per_sm`` co-resident CTAs per SM (the persistent
    grid is ``programs_per_sm × SMs / cluster`` clusters, each taking a contiguous range of row blocks);
    ``weight_in_smem``: the weight (slice) is staged in shared memory once per CTA, else read from global memory
    (L2) per row; ``hold``: a row's share stays in registers (float32) from the kernel's first walk of it (the
    reduction) to its second (the outputs) instead of being read again from shared memory (None: ``holds``);
    ``direct`` (the forward of rows one CTA holds): no staging, a CTA per block of ``block_rows`` rows loads them
    from global memory straight into registers and stores its outputs straight back (None: ``directs``).
    """

    block_rows: int = 1
    stages: int = 2
    cluster: int | None = None
    programs_per_sm: int = 1
    weight_in_smem: bool = True
    hold: bool | None = None
    direct: bool | None = None

    def __post_init__(self) -> None:
        for name in ("block_rows", "stages", "programs_per_sm"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if self.cluster is not None and self.cluster not in CLUSTERS:
            raise ValueError(f"cluster must be None or one of {CLUSTERS}, got {self.cluster!r}")
        if not isinstance(self.weight_in_smem, bool):
            raise ValueError(f"weight_in_smem must be a bool, got {self.weight_in_smem!r}")
        for name in ("hold", "direct"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be None or a bool, got {getattr(self, name)!r}")


@dataclasses.dataclass(frozen=True)
class Plan:
    """A config fitted to one ``(m, n)`` launch: the padded row ``n_pad``, each CTA's columns ``width``, the grid
    of ``programs`` clusters of ``cluster`` CTAs, ``per`` row blocks per cluster, ``vec`` elements per thread
    access (16 bytes of the widest staged dtype); the backward's ``dw_spill`` last columns of ``width`` keep their
    float32 ``dweight`` partial in shared memory (the first ``width - dw_spill`` in registers); ``hold`` and
    ``direct`` as in ``MosaicConfig``, resolved (a direct plan: ``programs`` CTAs of ``block_rows`` rows each,
    ``per`` 1, nothing staged); ``per_sm`` the co-resident CTAs per SM its shared memory was fitted to."""

    m: int
    n: int
    n_pad: int
    width: int
    cluster: int
    block_rows: int
    stages: int
    programs: int
    per: int
    vec: int
    weight_in_smem: bool
    dw_spill: int = 0
    hold: bool = False
    direct: bool = False
    per_sm: int = 1

    def chunks(self) -> list[tuple[int, int]]:
        """``(offset, size)`` of the register chunks walking a CTA's ``width`` columns: chunks of
        ``128·vec`` elements, then halving tails down to 128 (one element per thread)."""
        full = THREADS * self.vec
        out = [(k * full, full) for k in range(self.width // full)]
        off, rem = len(out) * full, self.width % full
        size = full // 2
        while rem:
            if rem >= size:
                out.append((off, size))
                off, rem = off + size, rem - size
            size //= 2
        return out


def smem_bytes(plan: Plan, row_bytes: int, weight_bytes: int) -> int:
    """Shared memory of one CTA: ``stages`` blocks of the staged rows, the weight slice, the spilled float32
    ``dweight`` partial."""
    staged = plan.stages * plan.block_rows * plan.width * row_bytes
    weight = plan.width * weight_bytes if plan.weight_in_smem else 0
    return staged + weight + 4 * plan.dw_spill + SMEM_RESERVED


def dw_spill(width: int) -> int:
    """Columns of a CTA's ``width`` whose ``dweight`` partial does not fit ``DW_REGS`` registers per thread."""
    return max(0, width - DW_REGS * THREADS)


def fit(config: MosaicConfig | None, m: int, n: int, *, row_bytes: int, weight_bytes: int, widest: int,
        backward: bool, interpret: bool = False, grid_row_bytes: int | None = None) -> Plan:
    """The launch plan of ``config`` (the heuristic's when None) for ``(m, n)``. ``row_bytes``: bytes per column
    of every row buffer staged (x; residual, h, y when they differ; dy, dh_out in the backward); ``widest`` the
    largest itemsize among them. Rows are padded to a multiple of ``128·cluster`` columns. Stages, then block
    rows, then co-resident CTAs are lowered until a CTA fits in shared memory; :class:`Unsupported` when even
    one row's share (with the largest cluster) does not. The backward takes, among the clusters allowed, the
    smallest whose share keeps the ``dweight`` partial in registers, else the smallest that fits with the rest
    of it in shared memory (``dw_spill``). ``interpret``: Mosaic GPU's interpreter, which runs no clusters (one
    CTA per row) and has no register file (a partial that does not fit shared memory stays "in registers").
    ``grid_row_bytes`` (the fused add's backward, which stages ``dh_out`` beside ``rms_norm``'s buffers): the
    cluster, rows per block and CTAs per SM are those ``rms_norm``'s backward fits with buffers of this many bytes
    per column, so each CTA sums the same rows' ``dweight`` terms (the fused add's ``dweight`` is ``rms_norm``'s
    bits); this launch's own buffers then give up stages, then the weight's staging, until that grid fits."""
    if grid_row_bytes is not None and grid_row_bytes != row_bytes:
        grid = fit(config, m, n, row_bytes=grid_row_bytes, weight_bytes=weight_bytes, widest=widest,
                   backward=backward, interpret=interpret)
        return _restage(grid, row_bytes, weight_bytes)
    config = config or heuristic(m, n, backward=backward, itemsize=widest)
    vec = max(1, 16 // widest)
    aligned = cdiv(max(n, 1), ALIGN) * ALIGN  # one CTA's row (no cluster)
    if directs(config, backward, aligned):
        return Plan(m, n, aligned, aligned, 1, config.block_rows, 1, cdiv(max(m, 1), config.block_rows), 1, vec,
                    False, direct=True)
    if config.direct:
        raise ValueError(f"direct is a forward option of rows one CTA holds (at most {DIRECT_MAX_N} columns, no "
                         f"cluster), got {config} for a {'backward' if backward else 'forward'} of {n} columns")
    clusters = (1,) if interpret else (config.cluster,) if config.cluster else CLUSTERS
    for spill_ok in ((False, True) if backward else (True,)):
        for cluster in clusters:
            n_pad = cdiv(n, cluster * ALIGN) * cluster * ALIGN
            width = n_pad // cluster
            spill = dw_spill(width) if backward else 0
            if spill and not spill_ok:
                continue
            for s in (spill, 0) if interpret and spill else (spill,):
                plan = _shrink(config, m, n, n_pad, width, cluster, vec, s, holds(config, backward, s),
                               row_bytes, weight_bytes)
                if plan is not None:
                    return plan
    raise Unsupported(f"impl='mosaic' cannot hold a row of {n} columns with {config} (the Mosaic kernels stage "
                     f"whole rows; the limit is the shared memory of {MAX_CLUSTER} SMs); use impl='pallas' for "
                     "this shape")


def _shrink(config, m, n, n_pad, width, cluster, vec, spill, hold, row_bytes, weight_bytes) -> Plan | None:
    """``config``'s plan on ``cluster``, with stages, then block rows, then the weight staging, then the last
    stage given up until a CTA fits in shared memory (None when even that does not fit)."""
    rows, stages, weight_smem = config.block_rows, config.stages, config.weight_in_smem
    while True:
        plan = _plan(m, n, n_pad, width, cluster, rows, stages, config.programs_per_sm, vec, weight_smem, spill, hold)
        used = smem_bytes(plan, row_bytes, weight_bytes)
        if used <= SMEM_BYTES:
            per_sm = max(1, min(config.programs_per_sm, SMEM_BYTES // used))
            return _plan(m, n, n_pad, width, cluster, rows, stages, per_sm, vec, weight_smem, spill, hold)
        if stages > 2:
            stages -= 1
        elif rows > 1:
            rows //= 2
        elif weight_smem:
            weight_smem = False
        elif stages > 1:
            stages = 1
        else:
            return None


def _restage(grid: Plan, row_bytes: int, weight_bytes: int) -> Plan:
    """``grid``'s plan for buffers of ``row_bytes`` per column: its stages (then fewer, down to 2), then the weight
    from L2, then one stage, the first with which its ``per_sm`` CTAs fit one SM's shared memory."""
    steps = [(s, grid.weight_in_smem) for s in range(grid.stages, 1, -1)]
    steps += [(min(2, grid.stages), False)] * grid.weight_in_smem + [(1, False)]
    for stages, weight_smem in steps:
        plan = dataclasses.replace(grid, stages=stages, weight_in_smem=weight_smem)
        if grid.per_sm * smem_bytes(plan, row_bytes, weight_bytes) <= SMEM_BYTES:
            return plan
    raise Unsupported(f"the fused add's backward cannot stage {grid.per_sm} CTAs of {grid.width} columns per SM "
                      f"(rms_norm's grid for {grid.m}×{grid.n}); pass a bwd_config with fewer programs_per_sm")


def _plan(m, n, n_pad, width, cluster, rows, stages, per_sm, vec, weight_smem, spill, hold) -> Plan:
    blocks = cdiv(max(m, 1), rows)
    programs = max(1, min(per_sm * backend.num_sms() // cluster, blocks))
    per = cdiv(blocks, programs)
    return Plan(m, n, n_pad, width, cluster, rows, stages, programs, per, vec, weight_smem, spill, hold, per_sm=per_sm)


def holds(config: MosaicConfig, backward: bool, spill: int) -> bool:
    """``config.hold``, or by default: the backward holds (x, ``g``, and dy where ``holds_dy``) unless its
    ``dweight`` partial spills to shared memory; the forward does not (the long-row table sets it where it won).
    H100, bf16, kernels timed (2026-11-25, ``bench/results/mosaic_hold_spill_h100.md``): backward 32768×8192
    2.50 → 2.85 TB/s, 2048×131072 2.29 → 2.63, 8192×32768 2.45 → 2.81, 32768×16384 2.58 → 2.82, 32768×2304
    2.45 → 2.60, but 32768×4096 2.76 → 2.69 and 32768×3584 2.76 → 2.72; forward 1024×262144 2.21 → 2.37, yet
    2048×131072 (4 CTAs per SM) 2.76 → 1.99 and rows one CTA holds within ±1.3%."""
    if config.hold is not None:
        return config.hold
    return backward and not spill


# The forward of rows one CTA holds (up to this many padded columns) reads them from global memory straight into
# registers instead of staging them through shared memory (``direct``): the staged forward's one warpgroup per CTA
# and at most 4 CTAs per SM left its shared-memory loads exposed (ncu, 32768×4096: 15.5 warps per SM, half the stalls
# on shared-memory loads), where direct CTAs need no shared memory but the reduction's and fill the SM. The same
# chunks, hence the same bits. H100, bf16, kernels timed from JAX, staged → direct (twentieth session,
# probes_h100_2026-11-26_twentieth.md): 4096×1024 1.83 → 2.34 TB/s, 4096×4096 2.48 → 2.66, 4096×16384 2.66 → 2.89,
# 32768×1024 2.61 → 2.90, 32768×4096 2.68 → 2.98, 32768×8192 2.69 → 3.02, 32768×16384 2.80 → 3.03 (the Triton
# lowering's 2.35, 2.74, 2.92, 2.90, 3.00, 3.02, 3.03 in the same run); the fused add's forward alike.
DIRECT_MAX_N = 16384


def directs(config: MosaicConfig, backward: bool, n_pad: int) -> bool:
    """Whether ``config``'s forward of rows padded to ``n_pad`` columns (a multiple of ``ALIGN``) runs direct:
    unless ``config.direct`` is False, for rows of at most ``DIRECT_MAX_N`` of them without a cluster; never the
    backward (it keeps a ``dweight`` partial per persistent CTA)."""
    return not (backward or config.cluster not in (None, 1) or n_pad > DIRECT_MAX_N or config.direct is False)


def holds_dy(plan: Plan) -> bool:
    """Whether a holding backward keeps ``dy`` in registers too (else it keeps ``x`` and ``g`` and reads ``dy`` again
    from shared memory for the ``dweight`` terms): only for shares narrower than ``DW_REGS · THREADS`` columns. At
    8192 columns per CTA the held values and the ``dweight`` partial would need 256 registers per thread (ptxas
    gives 255 and spills). H100, bf16, kernels timed (2026-11-25, seventh session, the same bits): 2048×131072
    2.62 → 2.75 TB/s, 4096×65536 2.58 → 2.67, 32768×16384 2.85 → 2.90, 4096×16384 2.67 → 2.74, 32768×8192
    2.86 → 2.85; narrower shares lose a little without it (32768×5120 2.72 → 2.71, 8192×32768 2.79 → 2.78)."""
    return plan.width < DW_REGS * THREADS


# Long rows (``n_pad`` > 16384), from bench/results/sweep_h100_bfloat16_llama_mosaic.md (H100, bf16): the fastest
# (cluster, stages, CTAs per SM, weight in shared memory) per padded row length and direction. Forward: 32768 on
# pairs (16384 columns each, 3 stages: 2.70 TB/s, the default of the time 1.94). Backward: 32768 on clusters of 8,
# 3 stages, two CTAs per SM (2.43; 1.51); 65536 with the weight from L2, 2 stages, as many CTAs as fit (1.95; 1.54).
# Re-swept after the two-stage pipeline learnt to load first (sweep_h100_bfloat16_llama_mosaic_long.md, torch-timed;
# the same ranking kernel-timed in a separate run): forward 65536 on clusters of 8 with one stage and 4 CTAs per SM,
# the weight in shared memory (2.72 against 2.60 for 3 stages and 2 CTAs); the 65536 backward's config now reads
# 2.37 (1.95 before the reorder). Clusters of 16 (same session, kernel-timed): the forward at 131072 with one stage
# and 4 CTAs per SM (2.75 against 2.53 on clusters of 8), at 262144 with 2 (2.20 against 1.39 on 8, and the
# Triton lowering's 2.00); the backward at 131072 like 65536's on 8 (8192 columns per CTA: 2.30 against the Triton
# lowering's 1.76). The sixth session's ``hold``: the forward at 262144 holds its 16384 columns per CTA in registers
# (2.21 → 2.37, bench/results/mosaic_hold_spill_h100.md); the backward holds by default (``holds``), after which
# the table's configs stayed the fastest of their groups (sweep_h100_bfloat16_llama_mosaic_hold_long.md).
LONG_ROWS = {  # (backward, n_pad): (cluster, stages, CTAs per SM, weight in shared memory, hold)
    (False, 32768): (2, 3, 1, True, None), (False, 65536): (8, 1, 4, True, None),
    (False, 131072): (16, 1, 4, True, None), (False, 262144): (16, 1, 2, True, True),
    (True, 32768): (8, 3, 2, True, None), (True, 65536): (8, 2, 4, False, None),
    (True, 131072): (16, 2, 4, False, None),
}


# The backward of rows one CTA holds: a fourth stage where rows of more than 1024 columns make small blocks (at most
# SMALL_BLOCK_STAGES[0] elements per row buffer: 2304 or 2560 columns, or two rows of 1280) and each CTA walks at
# most SMALL_BLOCK_STAGES[1] blocks. H100, through JAX (kernel durations; fifteenth session,
# bench/results/probes_h100_2026-11-26.md), plain / fused add, 3 → 4 stages, TB/s: bf16 4096×2304 2.06 → 2.14 /
# 2.26 → 2.28, 8192×2304 2.32 → 2.43 / 2.54 → 2.57, 4096×2560 +3.4% / +0.7%, 8192×1280 +4.1% / +0.8%, 16384×1280
# +4.5% / -0.4%, 2048×2304 +3.7% / +1.0%; fp16 4096×2304 +5.0% / +1.2%; fp32 (twice the bytes per block) 4096×2304
# +0.6% / -0.2%. Outside the rule a fourth stage lost or tied: 3072-4096 columns (4096×4096 -0.2%, 8192×4096 -3.2%,
# 32768×3072 -6.6%), four rows of 640 (4096×640 -2.3%), 32768 rows of 1280 (62 blocks per CTA: -2%) and 2560
# (-0.7%); but 16384×2304 (62 blocks per CTA) gained 3.4% and 32768×2304 1-2%. Stages change no CTA's rows: the
# same dweight bits (tests/test_mosaic.py checks it on the GPU).
SMALL_BLOCK_STAGES = (2560, 32)

# Per GPU model: the backward of 16-bit rows of these widths (one CTA each) with these fields of the heuristic's
# config changed. H200, bf16, from JAX, kernels timed, plain / fused add TB/s (forty-fifth session,
# bench/results/probes_h200_2026-11-28_fortyfifth.md §2): 4 stages at 1536 (32768 rows 3.27 / 3.84 → 3.43 / 3.83,
# 4096 rows +0.6% / +1.3%) and 3072 (32768 rows 3.67 / 4.04 → 3.93 / 4.02, 8192 rows +5.4% / +0.9%, 4096 rows +5% /
# +0.8%); 2 CTAs per SM at 12288 (now ``BWD_PER_SM_BY_MODEL``'s; clusters of 2: 6144 columns each; 8192 rows 3.13
# / 3.51 → 3.82 / 3.93, 4096 rows 2.98 / 3.37 → 3.55 / 3.71), where the H100's rule of one beyond 8192 columns came
# from rows of 16384.
BWD_BY_MODEL: dict[str, dict[int, dict]] = {"h200": {1536: {"stages": 4}, 3072: {"stages": 4}}}
# Per GPU model: the backward of 16-bit rows of lo < n < hi columns (one CTA each, padded to 16384) runs this many
# CTAs per SM (clusters where their rows no longer fit: ``fit``). H200, bf16, from JAX, kernels timed, two rounds, the
# slower quoted (fifty-sixth session, bench/results/probes_h200_2026-11-29_fiftysixth.md §2), one CTA per SM → two,
# plain / fused add TB/s: llama 32768×10240 3.00 / 2.43 → 4.03 / 2.76, 8192×10240 2.90 / 2.37 → 3.79 / 2.68,
# 8192×14336 3.14 / 2.51 → 3.72 / 2.67, gemma 32768×10240 3.19 → 4.04 (plain); 12288 since the forty-fifth session
# (above). Three per SM: 3.26 / 2.53 at 32768×10240, level with two at 14336. 16384 runs the Triton lowering there.
BWD_PER_SM_BY_MODEL: dict[str, tuple[int, int, int]] = {"h200": (8192, 16384, 2)}


def heuristic(m: int, n: int, *, backward: bool, itemsize: int | None = None) -> MosaicConfig:
    """The default config for ``(m, n)``, from the committed sweep (``python -m bench sweep --kernels mosaic``).

    Rows one CTA holds (``n_pad`` ≤ 16384): the forward direct, a CTA per row (until the twentieth session staged:
    blocks of ``max(1, 2048 / n_pad)`` rows, 3 stages, 4 / 2 / 1 CTAs per SM for ``n_pad`` ≤ 4096 / 8192 / 16384);
    the backward with blocks of ``max(1, 4096 / n_pad)`` rows and 2 CTAs per SM up to 8192 columns, and a fourth
    stage for small blocks walked by few CTAs each (``SMALL_BLOCK_STAGES``); then, for 16-bit rows (``itemsize``
    2), this GPU model's CTAs per SM (``BWD_PER_SM_BY_MODEL``) and ``BWD_BY_MODEL``. Longer rows: ``LONG_ROWS``,
    else the largest cluster, 2 stages, one CTA per SM.
    """
    n_pad = next_pow2(n)
    if n_pad <= 16384:
        if not backward:
            return MosaicConfig(block_rows=1, direct=True)
        rows, per_sm = max(1, 4096 // n_pad), 2 if n_pad <= 8192 else 1
        lo, hi, wide_per_sm = this_model(BWD_PER_SM_BY_MODEL) or (0, 0, per_sm)
        per_sm = wide_per_sm if itemsize == 2 and lo < n < hi else per_sm
        few = cdiv(max(m, 1), rows) <= SMALL_BLOCK_STAGES[1] * per_sm * backend.num_sms()
        stages = 4 if n > 1024 and rows * n <= SMALL_BLOCK_STAGES[0] and few else 3
        fields = this_model(BWD_BY_MODEL).get(n, {}) if itemsize == 2 else {}
        return MosaicConfig(**{"block_rows": rows, "stages": stages, "programs_per_sm": per_sm, **fields})
    cluster, stages, per_sm, weight_smem, hold = LONG_ROWS.get((backward, n_pad), (MAX_CLUSTER, 2, 1, True, None))
    return MosaicConfig(block_rows=1, stages=stages, cluster=cluster, programs_per_sm=per_sm,
                        weight_in_smem=weight_smem, hold=hold)
