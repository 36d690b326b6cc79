"""``rms_norm`` on sharded arrays: each device normalises its own rows; activations are never gathered.

``forward``/``backward`` lift the 2-D functions of ``api`` (``forward_fn``/``backward_fn`` on ``(M, N)``) to an
N-D ``x``; the reshape to 2-D happens per shard, so rows never move between devices. Two routes:

- Auto mesh axes (``jax.jit`` with ``NamedSharding`` inputs): the N-D function is a ``custom_partitioning``
  whose rule keeps ``x``'s row sharding for ``x``, ``dy``, ``y``, ``dx`` and ``rstd``, asks for ``weight``
  replicated and ``psum``s ``dweight`` over the mesh axes that shard the rows. ``custom_partitioning`` has no
  batching rule, so a ``custom_vmap`` around it folds a ``vmap`` axis into the rows (per-example weights map
  the unpartitioned function, as before). On one device its lowering is the function itself.
- Explicit mesh axes (shardings in the types, ``jax.make_mesh``'s default): a ``shard_map`` with the same specs.

A sharded hidden (last) axis is refused with a ``ValueError``. In a process with a single device nothing is
wrapped: the N-D function is the 2-D function between two reshapes, as before.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec as P

F32 = jnp.float32


def partitioned() -> bool:
    """Whether the partition rules are used: only when JAX sees more than one device (default platform or CPU)."""
    if jax.device_count() > 1:
        return True
    try:
        return len(jax.devices("cpu")) > 1
    except RuntimeError:  # no CPU backend (e.g. JAX_PLATFORMS=cuda)
        return False


def _axes(entry: str | tuple[str, ...] | None) -> tuple[str, ...]:
    """Mesh axis names in one ``PartitionSpec`` entry (``None``, a name, or a tuple of names)."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def row_spec(shape: tuple[int, ...], spec: P, mesh: Mesh | AbstractMesh) -> tuple:
    """The spec entries kept on ``x``'s leading (row) axes; ``ValueError`` if the hidden axis is sharded.

    A row axis that its mesh axes do not divide evenly is asked for whole (uneven shards would be padded).
    """
    spec = tuple(spec) + (None,) * (len(shape) - len(spec))
    if _axes(spec[-1]):
        names = " × ".join(repr(a) for a in _axes(spec[-1]))
        raise ValueError(
            f"rms_norm: x of shape {tuple(shape)} has its hidden (last) axis sharded over mesh axis {names}; "
            "RMSNorm needs whole rows on every device. Reshard x so that its last axis is whole on every device "
            "and keep the row axes, e.g. x = jax.lax.with_sharding_constraint(x, P(..., None)) (or "
            "jax.sharding.reshard).")
    return tuple(e if size % math.prod(mesh.shape[a] for a in _axes(e)) == 0 else None
                 for size, e in zip(shape[:-1], spec[:-1]))


def psum_rows(dweight: jax.Array, rows: tuple) -> jax.Array:
    """``dweight`` summed in float32 over the mesh axes that shard the rows (per-shard sums → the total)."""
    axes = tuple(a for e in rows for a in _axes(e))
    if not axes:
        return dweight
    return lax.psum(dweight.astype(F32), axes).astype(dweight.dtype)


def _varying(a: jax.Array) -> frozenset:
    """The manual (``shard_map``) mesh axes along which ``a`` varies."""
    return jax.typeof(a).manual_axis_type.varying


def _sum_dweight(grads: tuple, weight: tuple) -> tuple:
    """Inside ``shard_map``: ``dweight`` summed over the manual axes along which it varies but ``weight`` does
    not (a weight replicated over row shards gets the sum of the per-shard gradients)."""
    dx, dweight = grads
    if not weight:
        return dx, dweight
    axes = tuple(sorted(_varying(dweight) - _varying(weight[0])))
    return dx, (lax.psum(dweight.astype(F32), axes).astype(dweight.dtype) if axes else dweight)


def explicit_rows(x: jax.Array) -> tuple | None:
    """``x``'s row spec when its type carries a sharding of its rows over Explicit mesh axes, else ``None``."""
    sharding = jax.typeof(x).sharding
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty or AxisType.Explicit not in mesh.axis_types:
        return None
    rows = row_spec(x.shape, sharding.spec, mesh)
    return rows if any(rows) else None


def _reshard(v: jax.Array, x: jax.Array, spec: P) -> jax.Array:
    """``v`` resharded to ``spec`` on ``x``'s mesh (a no-op when it already is)."""
    return jax.sharding.reshard(v, NamedSharding(jax.typeof(x).sharding.mesh, spec))


def _shard_map(f: Callable, x: jax.Array, in_specs: tuple, out_specs: tuple) -> Callable:
    """``f`` mapped over the shards of ``x``'s mesh, manual over its Explicit axes (``check_vma=False``:
    ``pallas_call`` outputs carry no varying-axes type; the specs are right by construction)."""
    mesh = jax.typeof(x).sharding.mesh
    names = {a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit}
    return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=names, check_vma=False)


def _rule(operands: list[str], results: str, has_weight: bool, weight_at: int = 1) -> dict:
    """Shardy rule: rows (``...``) and hidden ``n`` pass through; the weight's own factor ``k`` is replicated
    (a separate factor, so a sharded weight never pushes its sharding onto ``x``'s hidden axis)."""
    if has_weight:
        operands = [*operands[:weight_at], "k", *operands[weight_at:]]
    return dict(sharding_rule=f"{', '.join(operands)} -> {results}",
                need_replication_factors=("k",) if has_weight else ())


@functools.lru_cache(maxsize=None)
def forward(fwd_2d: Callable, has_weight: bool, fused: bool = False, local_only: bool = False) -> Callable:
    """``f(x, *weight) -> (y, rstd)`` on N-D ``x`` (``rstd``: shape ``x.shape[:-1]``) from a 2-D ``fwd_2d``;
    ``fused``: ``f(x, residual, *weight) -> (y, h, rstd)`` (the fused add). ``local_only``: never partitioned
    (Mosaic GPU's interpreter, whose ordered host callbacks ``custom_partitioning`` cannot carry)."""
    k = 1 + fused  # row operands, and row results besides rstd

    def local(*args):
        shape = args[0].shape
        outs = fwd_2d(*(a.reshape(-1, shape[-1]) for a in args[:k]), *args[k:])
        return (*(o.reshape(shape) for o in outs[:k]), outs[k].reshape(shape[:-1]))

    def partition(mesh: Mesh, arg_shapes: tuple, result_shape: tuple) -> tuple:
        x = arg_shapes[0]
        rows = row_spec(x.shape, x.sharding.spec, mesh)
        x_sh, r_sh = NamedSharding(mesh, P(*rows, None)), NamedSharding(mesh, P(*rows))
        return mesh, local, (*(x_sh,) * k, r_sh), (*(x_sh,) * k, *(NamedSharding(mesh, P()),) * has_weight)

    cp = custom_partitioning(local)
    cp.def_partition(partition, **_rule(["... n"] * k, "... n, " * k + "...", has_weight, weight_at=k))
    f = custom_vmap(lambda *args: cp(*args))

    @f.def_vmap
    def _batched(axis_size, in_batched, *args):
        if len(args) > k and in_batched[k]:  # per-example weights: the unpartitioned function, vmapped as before
            return jax.vmap(local, in_axes=tuple(0 if b else None for b in in_batched))(*args), (True,) * (k + 1)
        args = [a if b or i >= k else jnp.broadcast_to(a, (axis_size, *a.shape))
                for i, (a, b) in enumerate(zip(args, in_batched))]
        return f(*args), (True,) * (k + 1)  # the vmap axis is one more row axis

    def call(*args):
        if local_only or not partitioned():
            return local(*args)
        x = args[0]
        rows = explicit_rows(x)
        if rows is None:
            return f(*args)
        xs, rs = P(*rows, None), P(*rows)
        run = _shard_map(local, x, (*(xs,) * k, *(P(),) * has_weight), (*(xs,) * k, rs))
        return run(*(_reshard(v, x, xs) for v in args[:k]), *(_reshard(v, x, P()) for v in args[k:]))

    return call


@functools.lru_cache(maxsize=None)
def backward(bwd_2d: Callable, has_weight: bool, fused: bool = False, local_only: bool = False) -> Callable:
    """``f(x, *weight, dy, rstd) -> (dx, dweight)`` on N-D ``x``/``dy`` from a 2-D ``bwd_2d``; ``dweight`` is
    ``None`` without a weight. ``fused``: ``f(h, *weight, dy, dh_out, rstd)`` (the fused add's backward);
    ``local_only`` as for :func:`forward`."""
    k = 1 + fused  # row cotangents (dy[, dh_out])

    def local(x, *rest):
        n = x.shape[-1]
        w, cts, rstd = rest[:has_weight], rest[has_weight:-1], rest[-1]
        dx, dweight = bwd_2d(x.reshape(-1, n), *w, *(c.reshape(-1, n) for c in cts), rstd.reshape(-1))
        return dx.reshape(x.shape), dweight

    def sharded(rows: tuple) -> Callable:
        """The per-shard function: the shard's ``dx``; ``dweight`` summed over the row shards."""
        def run(x, *rest):
            dx, dweight = local(x, *rest)
            return (dx, psum_rows(dweight, rows)) if has_weight else (dx,)
        return run

    def partition(mesh: Mesh, arg_shapes: tuple, result_shape: tuple) -> tuple:
        x = arg_shapes[0]
        rows = row_spec(x.shape, x.sharding.spec, mesh)
        x_sh, r_sh, w_sh = (NamedSharding(mesh, P(*rows, None)), NamedSharding(mesh, P(*rows)),
                            NamedSharding(mesh, P()))
        return mesh, sharded(rows), (x_sh, *(w_sh,) * has_weight), (x_sh, *(w_sh,) * has_weight, *(x_sh,) * k, r_sh)

    def unpack(out: tuple) -> tuple:
        return out[0], out[1] if has_weight else None

    cp = custom_partitioning(sharded(()))
    cp.def_partition(partition, **_rule(["... n"] * (1 + k) + ["..."], "... n" + ", k" * has_weight, has_weight))
    f = custom_vmap(lambda x, *rest: unpack(cp(x, *rest)))

    @f.def_vmap
    def _batched(axis_size, in_batched, *args):
        if has_weight:  # every example needs its own dweight
            return jax.vmap(local, in_axes=tuple(0 if b else None for b in in_batched))(*args), (True, True)
        args = [a if b else jnp.broadcast_to(a, (axis_size, *a.shape)) for a, b in zip(args, in_batched)]
        return (f(*args)[0], None), (True, None)

    def call(x, *rest):
        if local_only or not partitioned():
            return _sum_dweight(local(x, *rest), rest[:has_weight])
        rows = explicit_rows(x)
        if rows is None:
            return _sum_dweight(f(x, *rest), rest[:has_weight])
        w, cts, rstd = rest[:has_weight], rest[has_weight:-1], rest[-1]
        xs, rs = P(*rows, None), P(*rows)
        run = _shard_map(sharded(rows), x, (xs, *(P(),) * has_weight, *(xs,) * k, rs),
                         (xs, P()) if has_weight else (xs,))
        w = [_reshard(v, x, P()) for v in w]
        return unpack(run(_reshard(x, x, xs), *w, *(_reshard(c, x, xs) for c in cts), _reshard(rstd, x, rs)))

    return call
