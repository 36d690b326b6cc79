"""``impl="mosaic"``: the launchers of the Mosaic GPU kernels (``mosaic_kernels``) on 2-D inputs.

``forward``/``backward`` take and return what ``kernels.forward``/``kernels.backward`` do, so the custom VJP,
``vmap`` and sharding rules of ``api`` serve both lowerings. Rows are padded with zeros to a multiple of 128
columns when they are not one already (an extra copy; ``impl=None`` does not pick Mosaic for such shapes);
the padding changes no value: zeros add nothing to the sums and are cut from the results.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import backend, mosaic_config
from .mosaic_config import MosaicConfig, Plan
from .mosaic_kernels import _bwd_kernel, _dweight_reduce_kernel, _fwd_direct_kernel, _fwd_kernel

F32 = jnp.float32


def _pad_cols(a, n_pad: int):
    return a if a is None or a.shape[-1] == n_pad else jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, n_pad - a.shape[-1])])


def _itemsize(*dtypes) -> list[int]:
    return [jnp.dtype(d).itemsize for d in dtypes if d is not None]


def _kernel(body, plan: Plan, out_type, scratch, name: str, interpret: bool):
    plgpu = backend.mosaic()
    cluster = dict(cluster=(plan.cluster,), cluster_names=("c",)) if plan.cluster > 1 else {}
    return plgpu.kernel(body, out_type=out_type, scratch_types=scratch, grid=(plan.programs,), grid_names=("p",),
                        compiler_params=backend.mosaic_params(interpret=interpret),
                        interpret=backend.mosaic_interpret(interpret), kernel_name=name, **cluster)


def _plan_and_scratch(config, m: int, n: int, row_dtypes: list, weight_dtype, loaded: int, *, backward: bool,
                      interpret: bool, grid_dtypes: list | None = None) -> tuple[Plan, tuple]:
    """The fitted plan, and the scratch in the order the kernels take it (``mosaic_cta.Cta``): a staging
    buffer per row dtype, ``[dw_s]`` (the backward's spilled ``dweight`` partial), ``[w_s], [part_s], bars,
    [wbar], [cbar]``; ``loaded``: the buffers filled by TMA; ``grid_dtypes``: the row dtypes whose plan's grid
    this one keeps (``mosaic_config.fit``'s ``grid_row_bytes``)."""
    plgpu = backend.mosaic()
    plan = mosaic_config.fit(config, m, n, row_bytes=sum(_itemsize(*row_dtypes)),
                             weight_bytes=0 if weight_dtype is None else jnp.dtype(weight_dtype).itemsize,
                             widest=max(_itemsize(*row_dtypes)), backward=backward, interpret=interpret,
                             grid_row_bytes=None if grid_dtypes is None else sum(_itemsize(*grid_dtypes)))
    if plan.direct:  # nothing staged
        return plan, ()
    staged_weight = weight_dtype is not None and plan.weight_in_smem
    copies = loaded * (1 if plan.cluster == 1 else plan.block_rows)  # a copy per buffer, or per row's share
    clustered = plan.cluster > 1
    scratch = [plgpu.SMEM((plan.stages, plan.block_rows, plan.width), d) for d in row_dtypes]
    scratch += [plgpu.SMEM((plan.dw_spill,), F32)] * (plan.dw_spill > 0)
    scratch += [plgpu.SMEM((plan.width,), weight_dtype)] * staged_weight
    scratch += [plgpu.SMEM((2, plan.block_rows, plan.cluster), F32)] * clustered
    scratch += [plgpu.Barrier(num_arrivals=copies, num_barriers=plan.stages)]
    scratch += [plgpu.Barrier(num_arrivals=1)] * staged_weight
    scratch += [plgpu.ClusterBarrier(collective_axes=("c",), num_barriers=2)] * clustered
    return plan, tuple(scratch)


def forward_kernel(m: int, n: int, x_dtype, weight_dtype, *, eps: float, offset: float, casting: str,
                   config: MosaicConfig | None, interpret: bool, residual_dtype=None, h_dtype=None):
    """``(kernel, plan)``: the forward's Mosaic kernel for ``(m, n)`` rows, called on the rows padded to
    ``plan.n_pad`` columns (``x, [residual], [weight]``), returning ``y, [h]`` (padded) and ``rstd`` ``(m,)``."""
    fused = residual_dtype is not None
    hdt = jnp.dtype(h_dtype if fused else x_dtype)
    split_h = fused and jnp.dtype(residual_dtype) != hdt
    split_y = jnp.dtype(x_dtype) != hdt
    row_dtypes = [x_dtype] + ([residual_dtype] if fused else []) + [hdt] * (split_h + split_y)
    plan, scratch = _plan_and_scratch(config, m, n, row_dtypes, weight_dtype, 1 + fused, backward=False,
                                      interpret=interpret)
    has_weight = weight_dtype is not None
    out_rows = jax.ShapeDtypeStruct((m, plan.n_pad), hdt)
    out_type = (out_rows, *((out_rows,) if fused else ()), jax.ShapeDtypeStruct((m,), F32))
    split = {} if plan.direct else dict(split_h=split_h, split_y=split_y)
    body = functools.partial(_fwd_direct_kernel if plan.direct else _fwd_kernel, plan=plan, eps=eps, offset=offset,
                             casting=casting, has_weight=has_weight, fused=fused, **split)
    name = "mosaic_norm_add_fwd" if fused else "mosaic_norm_fwd"
    return _kernel(body, plan, out_type, scratch, name, interpret), plan


def forward(x, weight, *, eps: float, offset: float, casting: str, config: MosaicConfig | None, interpret: bool,
            residual=None, h_dtype=None):
    """``(y, rstd)`` for a 2-D ``x`` of shape ``(m, n)`` (``rstd`` float32 ``(m,)``); with ``residual`` (the
    fused add) ``(y, h, rstd)``, ``h = r(x + residual)`` in ``h_dtype`` and ``y`` the norm of ``h``."""
    m, n = x.shape
    kernel, plan = forward_kernel(m, n, x.dtype, None if weight is None else weight.dtype, eps=eps, offset=offset,
                                  casting=casting, config=config, interpret=interpret,
                                  residual_dtype=None if residual is None else residual.dtype, h_dtype=h_dtype)
    args = [_pad_cols(a, plan.n_pad) for a in (x, residual, weight) if a is not None]
    *row_outs, rstd = kernel(*args)
    return (*(o[:, :n] if plan.n_pad != n else o for o in row_outs), rstd)


def backward(x, weight, dy, rstd, *, offset: float, casting: str, config: MosaicConfig | None, interpret: bool,
             need_dx: bool = True, need_dw: bool = True, dh_out=None):
    """``(dx, dweight)`` for 2-D ``x``/``dy`` (``None`` for what is not needed); ``dy`` is only read. With
    ``dh_out`` (the fused add's backward, ``x`` being ``h``): ``dx = r(dx_norm + dh_out)``."""
    m, n = x.shape
    need_dw = need_dw and weight is not None
    if not (need_dx or need_dw):
        return None, None
    fused = dh_out is not None and need_dx
    row_dtypes = [x.dtype, dy.dtype] + ([dh_out.dtype] if fused else [])
    plan, scratch = _plan_and_scratch(config, m, n, row_dtypes, None if weight is None else weight.dtype,
                                      len(row_dtypes), backward=True, interpret=interpret,
                                      grid_dtypes=row_dtypes[:2] if fused else None)
    out_type = []
    if need_dx:
        out_type.append(jax.ShapeDtypeStruct((m, plan.n_pad), x.dtype))
    if need_dw:
        out_type.append(jax.ShapeDtypeStruct((plan.programs, plan.n_pad), F32))
    body = functools.partial(_bwd_kernel, plan=plan, offset=offset, casting=casting, has_weight=weight is not None,
                             need_dx=need_dx, need_dw=need_dw, fused=fused)
    args = [_pad_cols(a, plan.n_pad) for a in (x, weight, dy, dh_out if fused else None) if a is not None]
    outs = list(_kernel(body, plan, tuple(out_type), scratch,
                        "mosaic_norm_add_bwd" if fused else "mosaic_norm_bwd", interpret)(*args, rstd))
    dx = outs.pop(0) if need_dx else None
    if dx is not None and plan.n_pad != n:
        dx = dx[:, :n]
    dweight = None
    if need_dw:
        dweight = _dweight_reduce(outs.pop(0), weight.dtype, interpret)
        dweight = dweight if plan.n_pad == n else dweight[:n]
    return dx, dweight


REDUCE_COLS = 128  # columns per CTA of the dweight reduction (one float32 per thread: many CTAs, many loads in flight)
REDUCE_UNROLL = 128  # loads in flight per thread; the adds stay in order p = 0, 1, … (the same bits at any unroll).
# H100, bf16, kernels timed (2026-11-25): the reduction of 264 partial rows at N = 1024 (8 CTAs) 5.7 → 3.0 µs
# against unroll 16, so the backward 4096×1024 1.67 → 2.03 TB/s, 4096×4096 2.17 → 2.31, 32768×4096 2.66 → 2.70;
# 32 and 64 in between; no change where the partials are large (4096×65536: 6 µs, bandwidth)
REDUCE_GROUPS = (8, 4, 2)  # CTAs per cluster sharing a column block's partial rows (the largest dividing their count
# into shares of at least REDUCE_MIN_SHARE rows): a chain of ``parts / groups`` loads per CTA instead of ``parts``
REDUCE_MIN_SHARE = 16


def reduce_groups(parts: int, interpret: bool) -> int:
    """CTAs per column block of the dweight reduction: 1 under the interpreter (it runs no clusters) or where no
    ``REDUCE_GROUPS`` size divides ``parts`` into shares of at least ``REDUCE_MIN_SHARE``."""
    if interpret:
        return 1
    return next((g for g in REDUCE_GROUPS if parts % g == 0 and parts // g >= REDUCE_MIN_SHARE), 1)


def _dweight_reduce(partials, dtype, interpret: bool):
    """The float32 partials ``(programs, n_pad)`` summed over programs in a fixed order, in ``dtype``."""
    plgpu = backend.mosaic()
    parts, n_pad = partials.shape
    groups = reduce_groups(parts, interpret)
    body = functools.partial(_dweight_reduce_kernel, parts=parts, cols=REDUCE_COLS, unroll=REDUCE_UNROLL,
                             groups=groups)
    cluster = {}
    if groups > 1:
        cluster = dict(cluster=(groups,), cluster_names=("g",),
                       scratch_types=(plgpu.SMEM((REDUCE_COLS,), F32),
                                      plgpu.ClusterBarrier(collective_axes=("g",), num_barriers=2)))
    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((n_pad,), dtype), grid=(n_pad // REDUCE_COLS,),
                        grid_names=("col",), compiler_params=backend.mosaic_params(interpret=interpret),
                        interpret=backend.mosaic_interpret(interpret), kernel_name="mosaic_norm_dweight_reduce",
                        **cluster)(partials)
