"""What every Mosaic GPU kernel of ``mosaic_kernels`` sets up the same way: register chunk layouts, a CTA's place
in the persistent grid and its cluster (``Cta``), its TMA staging pipeline (``Staging``), the cluster-wide row sum
through distributed shared memory (``cluster_sum``) and chunk loads of staged rows and the weight.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from . import backend, rowmath
from .mosaic_config import Plan
from .rounding import rounder

F32 = jnp.float32


def layout(size: int):
    """The register layout of a chunk of ``size`` elements (``WG_STRIDED``: each of the warpgroup's 128 threads
    owns ``size / 128`` consecutive elements)."""
    plgpu = backend.mosaic()
    return plgpu.Layout.WG_STRIDED((size,), vec_size=max(1, size // 128))


def scalar_sum(parts):
    """Σ of per-chunk partial vectors: chunks of one size are added elementwise first (in chunk order), then
    each size's vector is reduced, larger sizes first (a fixed order)."""
    by_size: dict[int, jnp.ndarray] = {}
    for v in parts:
        by_size[v.shape[0]] = v if v.shape[0] not in by_size else by_size[v.shape[0]] + v
    total = None
    for size in sorted(by_size, reverse=True):
        s = jnp.sum(by_size[size])
        total = s if total is None else total + s
    return total


class Staging:
    """TMA traffic of one CTA: block ``t`` of its range into stage ``t % stages`` and back out."""

    def __init__(self, plan: Plan, pid, col0):
        self.plan, self.pid, self.col0 = plan, pid, col0
        self.first = pid * plan.per
        blocks = -(-max(plan.m, 1) // plan.block_rows)
        self.count = jnp.clip(blocks - self.first, 0, plan.per)

    def row0(self, t):
        return (self.first + t) * self.plan.block_rows

    def rows_valid(self, t):
        return jnp.minimum(self.plan.block_rows, self.plan.m - self.row0(t))

    def _pairs(self, gmem, smem, t):
        """(gmem slice, smem slice) pairs moving block ``t``: one contiguous copy of whole rows, or a row's share
        per copy in a cluster."""
        pl = pallas()
        p, s = self.plan, t % self.plan.stages
        if p.cluster == 1:
            return [(gmem.at[pl.ds(self.row0(t), p.block_rows)], smem.at[s])]
        return [(gmem.at[pl.ds(self.row0(t) + r, 1), pl.ds(self.col0, p.width)], smem.at[s, pl.ds(r, 1)])
                for r in range(p.block_rows)]

    def load(self, t, pairs, bars):
        plgpu = backend.mosaic()
        for gmem, smem in pairs:
            for g, s in self._pairs(gmem, smem, t):
                plgpu.copy_gmem_to_smem(g, s, bars.at[t % self.plan.stages], oob_mode=plgpu.OOBFillMode.UNDEFINED)

    def store(self, t, pairs):
        plgpu = backend.mosaic()
        moves = [m for smem, gmem in pairs for m in self._pairs(gmem, smem, t)]
        for i, (g, s) in enumerate(moves):
            plgpu.copy_smem_to_gmem(s, g, commit_group=i == len(moves) - 1)

    def pipeline(self, loads, bars, step, carry):
        """``carry = step(t, s, carry)`` for each block ``t`` of this CTA (``step`` issues the block's stores; a
        stage is reloaded once the store reading it is done). The first ``max(stages - 1, 1)`` blocks are loaded
        before the loop.

        Two stages: block ``t + 1`` is loaded into the stage block ``t - 1`` was stored from *before* block ``t``
        is computed (waiting for that store's reads first), so one load is in flight during the compute; loading it
        after (the order for more stages) would leave none. More stages: the load of block ``t + stages - 1`` is
        issued after block ``t``'s compute, once the store of block ``t - 1`` is done (a store still in flight is
        not waited for); ``stages - 2`` loads are in flight during the compute. H100 (bf16, kernels timed;
        ``docs/benchmarks.md``): two stages, load first, 2048×131072 forward (cluster 8, weight in shared memory)
        1.65 → 2.31 TB/s, 4096×65536 backward 1.98 → 2.41; three stages, load first, slower everywhere measured
        (2048×131072 forward 1.49 → 1.35)."""
        plgpu, pl = backend.mosaic(), pallas()
        stages = self.plan.stages
        first = stages == 2
        ahead = max(stages - 1, 1)
        for j in range(ahead):
            @pl.when(j < self.count)
            def _():
                self.load(j, loads, bars)

        def body(t, c):
            s = t % stages
            if first:
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

                @pl.when(t + 1 < self.count)
                def _():
                    self.load(t + 1, loads, bars)
            plgpu.barrier_wait(bars.at[s])
            c = step(t, s, c)
            if not first:
                plgpu.wait_smem_to_gmem(1 if stages > 1 else 0, wait_read_only=True)

                @pl.when(t + ahead < self.count)
                def _():
                    self.load(t + ahead, loads, bars)
            return c

        return lax.fori_loop(0, self.count, body, carry)


@functools.cache
def pallas():
    from jax.experimental import pallas as pl

    return pl


def cluster_sum(plan: Plan, cta: "Cta", parity, partial_of):
    """Every row's sum over the cluster: each CTA writes ``partial_of(r)`` (its share's) to its own slot
    ``part_s[parity, r, j]``; all arrive and wait, then each reads every CTA's slot in cluster order (the same sum
    everywhere). The warpgroup barrier first orders the slots' stores before the arrival (another thread of the
    warpgroup signals the peers' barriers). A slot is rewritten two blocks later, after every CTA has passed the
    next block's barrier, hence after every read of it."""
    plgpu = backend.mosaic()
    part_s, cbar, rows = cta.part_s, cta.cbar, plan.block_rows
    for r in range(rows):
        part_s[parity, r, cta.j] = partial_of(r)
    plgpu.commit_smem()
    plgpu.barrier_arrive(cbar.at[parity])
    plgpu.barrier_wait(cbar.at[parity])
    out = []
    for r in range(rows):
        tot = plgpu.cluster_ref(part_s, {"c": 0})[parity, r, 0]
        for q in range(1, plan.cluster):
            tot = tot + plgpu.cluster_ref(part_s, {"c": q})[parity, r, q]
        out.append(tot)
    return out


def weight_chunk(w_g, w_s, col0, off, size, offset, casting, dt):
    """``w_eff`` of one chunk (float32), from the staged slice or global memory (None without a weight)."""
    if w_g is None:
        return None
    pl, plgpu = pallas(), backend.mosaic()
    src = w_s.at[pl.ds(off, size)] if w_s is not None else w_g.at[pl.ds(col0 + off, size)]
    return effective_weight(plgpu.load(src, layout=layout(size)), offset, casting, dt)


def effective_weight(w, offset, casting, dt):
    """``w_eff`` (float32) of a weight chunk loaded as stored."""
    return rowmath.effective_weight(w.astype(F32), F32(offset), casting, rounder(dt))


class Cta:
    """What every kernel sets up the same way: the trailing scratch refs (``[w_s], [part_s], bars, [wbar],
    [cbar]``), this CTA's place (cluster ``pid``, rank ``j``, first column ``col0``), its staging and chunks, and
    the weight slice staged in shared memory (when the plan says so)."""

    def __init__(self, plan: Plan, it, w_g):
        pl, plgpu = pallas(), backend.mosaic()
        self.w_s = next(it) if w_g is not None and plan.weight_in_smem else None
        self.part_s = next(it) if plan.cluster > 1 else None
        self.bars = next(it)
        wbar = next(it) if self.w_s is not None else None
        self.cbar = next(it) if plan.cluster > 1 else None
        self.pid = lax.axis_index("p")
        self.j = lax.axis_index("c") if plan.cluster > 1 else 0
        self.col0 = self.j * plan.width
        self.st = Staging(plan, self.pid, self.col0)
        self.chunks = plan.chunks()
        if self.w_s is not None:
            plgpu.copy_gmem_to_smem(w_g.at[pl.ds(self.col0, plan.width)], self.w_s, wbar,
                                    oob_mode=plgpu.OOBFillMode.UNDEFINED)
            plgpu.barrier_wait(wbar)


def gmem_chunk(ref, row, off: int, size: int):
    """Chunk ``[off, off + size)`` of row ``row`` of a 2-D global-memory ref, loaded into registers in the chunk
    layout, widened to float32 (the direct forward's loads)."""
    pl, plgpu = pallas(), backend.mosaic()
    return plgpu.load(ref.at[row, pl.ds(off, size)], layout=layout(size)).astype(F32)


def load_chunk(ref, s, r, off: int, size: int):
    """Chunk ``[off, off + size)`` of row ``r`` of stage ``s`` of a staging buffer, widened to float32."""
    pl, plgpu = pallas(), backend.mosaic()
    return plgpu.load(ref.at[s, r, pl.ds(off, size)], layout=layout(size)).astype(F32)
