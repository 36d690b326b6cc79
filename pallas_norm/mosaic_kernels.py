"""The Mosaic GPU RMSNorm kernels (``impl="mosaic"``): forward, backward, and their fused residual-add forms.

Each CTA is one warpgroup on a persistent grid of ``plan.programs`` clusters; a cluster takes a contiguous range
of row blocks. A block (``plan.block_rows`` rows, or each CTA's ``1/cluster`` share of them) is staged in shared
memory by TMA bulk copies, ``plan.stages`` blocks deep, so global memory is read exactly once per pass: the sum
of squares (forward) or ``Σ g·x`` (backward) walks the staged row, and the second walk writes the result in
place, from where a TMA store writes it back. In a cluster each CTA reduces its share and the partial sums are
exchanged through distributed shared memory (the same fixed order in every CTA, hence the same ``rstd``).
Row math comes from ``rowmath``; rows are walked in chunks of ``128·vec`` elements (``WG_STRIDED`` layout: every
thread owns ``vec`` consecutive elements, 16 bytes of the widest dtype), and with ``plan.hold`` the first walk's
chunks stay in registers for the second (the backward's ``dy`` only in shares under 8192 columns: ``holds_dy``).
The forward of rows of at most ``mosaic_config.DIRECT_MAX_N`` columns (``plan.direct``) stages nothing: each CTA
loads its rows from global memory straight into registers, in the same chunks (the same bits), and stores back.
The backward keeps each CTA's float32 ``dweight`` partial (its columns' share of every row it walks) in
registers, and the columns beyond ``DW_REGS`` per thread in shared memory (``plan.dw_spill``: rows of 262144
columns, 16384 per CTA); a second kernel sums the partials in a fixed order (deterministic).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from . import backend, rowmath
from .mosaic_config import Plan, holds_dy
from .mosaic_cta import (Cta, cluster_sum, effective_weight, gmem_chunk, layout, load_chunk, pallas, scalar_sum,
                         weight_chunk)
from .rounding import rounder

F32 = jnp.float32


def _cluster_exit(plan: Plan, cta: "Cta") -> None:
    """In a cluster, a CTA leaves only once every peer has arrived after its last block: the peers read its slots of
    that block through distributed shared memory, and shared memory of an exited CTA may not be read (it failed with
    "unspecified launch failure" on the H100: 8192×32768, cluster 4, 2 CTAs per SM). The barrier after the last
    block's is ``count % 2`` (blocks alternate between the two)."""
    if plan.cluster == 1:
        return
    plgpu = backend.mosaic()
    parity = cta.st.count % 2
    plgpu.barrier_arrive(cta.cbar.at[parity])
    plgpu.barrier_wait(cta.cbar.at[parity])


def _fwd_refs(it, fused: bool, has_weight: bool) -> tuple:
    """A forward kernel's global refs from ``it``: ``x, residual, weight, y, h, rstd`` (None where absent)."""
    x_g = next(it)
    res_g = next(it) if fused else None
    w_g = next(it) if has_weight else None
    return x_g, res_g, w_g, next(it), (next(it) if fused else None), next(it)


def _fwd_kernel(*refs, plan: Plan, eps, offset, casting, has_weight, fused, split_h, split_y):
    """Forward: ``y`` (and the fused add's ``h``) and ``rstd``. Refs: ``x, [residual], [weight]``, outputs
    ``y, [h], rstd (m,)``, scratch ``x_s, [res_s], [h_s], [y_s], [w_s], [part_s], bars, [wbar], [cbar]``. ``h``
    is written over the residual's staging buffer (``split_h``: its own buffer, when the dtypes differ) and ``y``
    over x's (``split_y`` likewise)."""
    pl, plgpu = pallas(), backend.mosaic()
    it = iter(refs)
    x_g, res_g, w_g, y_g, h_g, rstd_g = _fwd_refs(it, fused, has_weight)
    x_s = next(it)
    res_s = next(it) if fused else None
    h_s = (next(it) if split_h else res_s) if fused else x_s
    y_s = next(it) if split_y else x_s
    cta = Cta(plan, it, w_g)
    w_s, bars, st, chunks, j, col0 = cta.w_s, cta.bars, cta.st, cta.chunks, cta.j, cta.col0
    dt = y_g.dtype

    def row_values(s, r, off, size):
        """The row values normalised (float32): x, or ``h = r_h(x + residual)`` (also stored to ``h_s``)."""
        x32 = load_chunk(x_s, s, r, off, size)
        if not fused:
            return x32
        res32 = load_chunk(res_s, s, r, off, size)
        h32 = rowmath.residual_add(x32, res32, rounder(dt))
        h_s[s, r, pl.ds(off, size)] = h32.astype(dt)
        return h32

    def row_chunks(s, r):
        return [row_values(s, r, off, size) for off, size in chunks]

    def normalise(s, r, rstd, held):
        """``y`` of row ``r``, from the values of the first walk (``held``, when ``plan.hold``) or re-read."""
        for i, (off, size) in enumerate(chunks):
            h32 = held[i] if plan.hold else load_chunk(h_s if fused else x_s, s, r, off, size)
            n_val = rowmath.normalized(h32, rstd, casting, rounder(dt))
            w_eff = weight_chunk(w_g, w_s, col0, off, size, offset, casting, dt)
            y_s[s, r, pl.ds(off, size)] = rowmath.output(n_val, w_eff).astype(dt)

    def rstd_of(total):
        return rowmath.rstd_from_sumsq(total, F32(plan.n), F32(eps), lax.rsqrt)

    def step(t, s, c):
        valid = st.rows_valid(t)
        if plan.cluster == 1:
            @pl.loop(0, valid)
            def _(r):
                held = row_chunks(s, r)
                rstd = rstd_of(scalar_sum([_sq(v) for v in held]))
                normalise(s, r, rstd, held)
                rstd_g[st.row0(t) + r] = rstd
        else:
            held = [row_chunks(s, r) for r in range(plan.block_rows)]
            totals = cluster_sum(plan, cta, t % 2, lambda r: scalar_sum([_sq(v) for v in held[r]]))
            for r in range(plan.block_rows):
                rstd = rstd_of(totals[r])

                @pl.when(r < valid)
                def _():
                    normalise(s, r, rstd, held[r])

                @pl.when((r < valid) & (j == 0))
                def _():
                    rstd_g[st.row0(t) + r] = rstd
        plgpu.commit_smem()
        st.store(t, [(y_s, y_g)] + ([(h_s, h_g)] if fused else []))
        return c

    loads = [(x_g, x_s)] + ([(res_g, res_s)] if fused else [])
    st.pipeline(loads, bars, step, 0)
    _cluster_exit(plan, cta)
    plgpu.wait_smem_to_gmem(0)


def _sq(v):
    return v * v


def _fwd_direct_kernel(*refs, plan: Plan, eps, offset, casting, has_weight, fused):
    """Forward of ``plan.direct``: CTA ``p`` takes rows ``p·block_rows …``, loads them (and the residual) from
    global memory into registers in the staged kernel's chunks (the same sums, hence the same bits), and stores
    ``y`` (and ``h``) and ``rstd`` straight back. Refs: ``x, [residual], [weight]``, outputs ``y, [h], rstd``.
    Rows past ``m`` (the last block) load row ``m - 1`` again and store nothing. The weight is loaded first (as
    stored: half the registers of float32), so that no load waits behind the reduction."""
    pl, plgpu = pallas(), backend.mosaic()
    x_g, res_g, w_g, y_g, h_g, rstd_g = _fwd_refs(iter(refs), fused, has_weight)
    dt = y_g.dtype
    chunks = plan.chunks()
    rows = [lax.axis_index("p") * plan.block_rows + r for r in range(plan.block_rows)]
    ws = [None if w_g is None else plgpu.load(w_g.at[pl.ds(off, size)], layout=layout(size)) for off, size in chunks]

    def load(ref, row):
        return [gmem_chunk(ref, jnp.minimum(row, plan.m - 1), off, size) for off, size in chunks]

    held = [load(x_g, row) for row in rows]  # every row's loads before any row's math: all in flight at once
    if fused:
        held = [[rowmath.residual_add(x32, r32, rounder(dt)) for x32, r32 in zip(xs, load(res_g, row))]
                for xs, row in zip(held, rows)]
    for row, values in zip(rows, held):
        rstd = rowmath.rstd_from_sumsq(scalar_sum([_sq(v) for v in values]), F32(plan.n), F32(eps), lax.rsqrt)

        @pl.when(row < plan.m)
        def _():
            for (off, size), v, w in zip(chunks, values, ws):
                if fused:
                    h_g[row, pl.ds(off, size)] = v.astype(dt)
                w_eff = None if w is None else effective_weight(w, offset, casting, dt)
                n_val = rowmath.normalized(v, rstd, casting, rounder(dt))
                y_g[row, pl.ds(off, size)] = rowmath.output(n_val, w_eff).astype(dt)
            rstd_g[row] = rstd


def _bwd_kernel(*refs, plan: Plan, offset, casting, has_weight, need_dx, need_dw, fused):
    """Backward: ``dx`` (fused: ``dh = r(dx_norm + dh_out)``) and each cluster's float32 ``dweight`` partial.
    Refs: ``x, [weight], dy, [dh_out], rstd (m,)``, outputs ``[dx], [dweight partials (programs, n_pad)]``,
    scratch ``x_s, dy_s, [dh_s], [dw_s], [w_s], [part_s], bars, [wbar], [cbar]``. ``dx`` is written over the
    staged copy of ``dy`` (the caller's ``dy`` is only read). The ``dweight`` partial of the chunks at or beyond
    column ``width - dw_spill`` accumulates in ``dw_s`` (each thread reads and writes only its own elements, in
    the chunk's layout: no barrier), the others' in registers."""
    pl, plgpu = pallas(), backend.mosaic()
    it = iter(refs)
    x_g = next(it)
    w_g = next(it) if has_weight else None
    dy_g = next(it)
    dh_g = next(it) if fused else None
    rstd_g = next(it)
    dx_g = next(it) if need_dx else None
    dwp_g = next(it) if need_dw else None
    x_s, dy_s = next(it), next(it)
    dh_s = next(it) if fused else None
    dw_s = next(it) if plan.dw_spill else None
    cta = Cta(plan, it, w_g)
    w_s, bars, st, chunks, col0, pid = cta.w_s, cta.bars, cta.st, cta.chunks, cta.col0, cta.pid
    spill0 = plan.width - plan.dw_spill  # the first column whose partial is in dw_s
    hold_dy = holds_dy(plan)
    in_regs = [off < spill0 for off, _ in chunks]  # a prefix of the chunks
    dt = dy_g.dtype

    def grad_scale(s, r, off, size):
        w_eff = weight_chunk(w_g, w_s, col0, off, size, offset, casting, dt)
        dy32 = load_chunk(dy_s, s, r, off, size)
        return dy32, w_eff, rowmath.grad_scale(dy32, w_eff, casting, rounder(dt))

    def row_inputs(s, r):
        """``(x, dy, g)`` (float32) of each chunk of row ``r``."""
        out = []
        for off, size in chunks:
            dy32, _, g = grad_scale(s, r, off, size)
            out.append((load_chunk(x_s, s, r, off, size), dy32, g))
        return out

    def sum_gx(held):
        return scalar_sum([g * x32 for x32, _, g in held])

    def row_grads(s, r, rstd, total, dw, held):
        """``dx`` of row ``r`` and the ``dweight`` terms, from the first walk's values (``held``, when
        ``plan.hold``) or re-read."""
        dw = list(dw)
        for i, (off, size) in enumerate(chunks):
            if plan.hold:
                x32, dy32, g = held[i]
                if not hold_dy:
                    dy32 = load_chunk(dy_s, s, r, off, size)
            else:
                x32 = load_chunk(x_s, s, r, off, size)
                dy32, _, g = grad_scale(s, r, off, size)
            if need_dw:
                n_val = rowmath.normalized(x32, rstd, casting, rounder(dt))
                terms = rowmath.dweight_terms(dy32, n_val)
                if in_regs[i]:
                    dw[i] = dw[i] + terms
                else:
                    _spilled_add(dw_s, off - spill0, size, terms)
            if need_dx:
                dx = rowmath.grad_input(x32, g, rstd, total, F32(plan.n))
                if fused:
                    dx = rowmath.grad_residual(dx, load_chunk(dh_s, s, r, off, size))
                dy_s[s, r, pl.ds(off, size)] = dx.astype(dt)
        return tuple(dw)

    def step(t, s, dw):
        valid = st.rows_valid(t)
        base = st.row0(t)
        if plan.cluster == 1:
            def one_row(r, acc):
                held = row_inputs(s, r)
                return row_grads(s, r, rstd_g[base + r], sum_gx(held), acc, held)

            dw = lax.fori_loop(0, valid, one_row, dw)
        else:
            held = [row_inputs(s, r) for r in range(plan.block_rows)]
            totals = cluster_sum(plan, cta, t % 2, lambda r: sum_gx(held[r]))
            for r in range(plan.block_rows):
                dw = lax.cond(r < valid, lambda acc: row_grads(s, r, rstd_g[base + r], totals[r], acc, held[r]),
                              lambda acc: acc, dw)
        if need_dx:
            plgpu.commit_smem()
            st.store(t, [(dy_s, dx_g)])
        return dw

    def zeros(size):
        return plgpu.layout_cast(jnp.zeros((size,), F32), layout(size))

    spilled = [(off, size) for (off, size), reg in zip(chunks, in_regs) if not reg]
    if need_dw:
        for off, size in spilled:
            dw_s[pl.ds(off - spill0, size)] = zeros(size)
    loads = [(x_g, x_s), (dy_g, dy_s)] + ([(dh_g, dh_s)] if fused and need_dx else [])
    dw = st.pipeline(loads, bars, step, tuple(zeros(size) for (_, size), reg in zip(chunks, in_regs) if reg))
    _cluster_exit(plan, cta)
    if need_dw:
        for (off, size), acc in zip(chunks, dw):
            dwp_g[pid, pl.ds(col0 + off, size)] = acc
        for off, size in spilled:
            dwp_g[pid, pl.ds(col0 + off, size)] = plgpu.load(dw_s.at[pl.ds(off - spill0, size)],
                                                             layout=layout(size))
    plgpu.wait_smem_to_gmem(0)


def _spilled_add(dw_s, off: int, size: int, terms) -> None:
    """``dw_s[off : off + size] += terms`` (a chunk of the ``dweight`` partial kept in shared memory)."""
    pl, plgpu = pallas(), backend.mosaic()
    dw_s[pl.ds(off, size)] = plgpu.load(dw_s.at[pl.ds(off, size)], layout=layout(size)) + terms


def _dweight_reduce_kernel(dwp_g, dw_g, *scratch, parts: int, cols: int, unroll: int, groups: int):
    """``dweight[c] = Σ_p partials[p, c]`` for this CTA's ``cols`` columns, in a fixed order (deterministic; both
    stacks launch this kernel, hence the same bits). With ``groups`` > 1 a cluster of that many CTAs shares the
    column block: CTA g sums partial rows ``[g·share, (g+1)·share)`` in order, then CTA 0 adds the shares in
    cluster order through distributed shared memory (``scratch``: this CTA's share in shared memory, two cluster
    barriers). ``backend.ordered_sum`` adds the rows, ``unroll`` loads in flight (latency hidden, order kept)."""
    pl, plgpu = pallas(), backend.mosaic()
    c0 = lax.axis_index("col") * cols
    lay = layout(cols)
    share = parts // groups
    p0 = lax.axis_index("g") * share if groups > 1 else 0
    acc = backend.ordered_sum(lambda first, j: plgpu.load(dwp_g.at[p0 + first + j, pl.ds(c0, cols)], layout=lay),
                              share, min(unroll, share), plgpu.layout_cast(jnp.zeros((cols,), F32), lay))
    if groups == 1:
        dw_g[pl.ds(c0, cols)] = acc.astype(dw_g.dtype)
        return
    part_s, cbar = scratch
    part_s[...] = acc
    plgpu.commit_smem()
    plgpu.barrier_arrive(cbar.at[0])
    plgpu.barrier_wait(cbar.at[0])

    @pl.when(lax.axis_index("g") == 0)
    def _():
        total = plgpu.load(plgpu.cluster_ref(part_s, {"g": 0}), layout=lay)
        for q in range(1, groups):
            total = total + plgpu.load(plgpu.cluster_ref(part_s, {"g": q}), layout=lay)
        dw_g[pl.ds(c0, cols)] = total.astype(dw_g.dtype)

    plgpu.barrier_arrive(cbar.at[1])  # a CTA leaves once CTA 0 has read its share
    plgpu.barrier_wait(cbar.at[1])
