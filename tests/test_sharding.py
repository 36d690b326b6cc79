"""``rms_norm`` on sharded arrays: rows stay on their devices (no all-gather), ``dweight`` is summed over the row
shards, a sharded hidden axis is refused, and ``shard_map`` users get the unsharded result.

CPU tests need 4 CPU devices (``tests/conftest.py`` sets ``--xla_force_host_platform_device_count=4``). On CPU,
XLA's code for a row reduction depends on how many rows it sees, so ``y``/``dx`` are compared bitwise with the
same function run alone on each device's shard, and to a few float32 roundings with the whole array on one
device. GPU tests (``gpu`` marker, ≥ 2 GPUs) compare ``y``/``dx`` bitwise with one device: the kernel's plan,
hence each row's arithmetic, is the same for the whole array and for a shard at the sizes used there.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import pallas_norm as pn
from pallas_norm import sharding

from helpers import jax_inputs

F32 = jnp.float32
CPUS = jax.devices("cpu")
needs_4_cpus = pytest.mark.skipif(len(CPUS) < 4, reason="needs 4 CPU devices (XLA_FLAGS set in tests/conftest.py)")
CONFIGS = [(jnp.float32, "llama", 0.0), (jnp.bfloat16, "gemma", 1.0)]
RESHARDING = re.compile(r"\b(all-gather|all-to-all|collective-permute)")


def cpu_inputs(shape, dtype, offset: float, seed: int = 0) -> tuple:
    """``jax_inputs`` on the first CPU device: CPU tests compare CPU runs only, also on a GPU machine."""
    return jax.device_put(jax_inputs(shape, dtype, offset, seed=seed), CPUS[0])


def replicated(a: jax.Array, mesh: Mesh) -> jax.Array:
    return jax.device_put(a, NamedSharding(mesh, P()))


def make_mesh(shape: tuple[int, ...], names: tuple[str, ...], devices=CPUS, axis_type=AxisType.Auto) -> Mesh:
    return Mesh(np.array(devices[:math.prod(shape)]).reshape(shape), names, axis_types=(axis_type,) * len(names))


def grads(impl: str, **kw):
    """``jit(value_and_grad)`` of ``sum(y·dy)`` (a random cotangent), returning ``(y, dx, dweight)``."""

    def loss(x, weight, dy):
        y = pn.rms_norm(x, weight, impl=impl, **kw)
        return jnp.sum(y.astype(F32) * dy.astype(F32)), y

    def run(x, weight, dy):
        (_, y), (dx, dweight) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, weight, dy)
        return y, dx, dweight

    return jax.jit(run)


def per_shard(fn, sharding_: NamedSharding, x, *more) -> list[np.ndarray]:
    """``fn(x_block, *more_blocks)`` run alone (one device) on each device's block of rows, outputs reassembled."""
    blocks = {tuple((s.start, s.stop) for s in i): i for i in sharding_.devices_indices_map(x.shape).values()}
    outs = None
    for idx in blocks.values():
        res = [np.asarray(r) for r in fn(x[idx], *(a[idx] for a in more))]
        outs = outs or [np.zeros(x.shape, r.dtype) for r in res]
        for o, r in zip(outs, res):
            o[idx] = r
    return outs


def assert_dweight_close(got, want, x, dy, *, eps: float, offset: float, casting: str) -> None:
    """Sharded ``dweight`` (psum of per-shard sums) vs one device: the same sum in another order. Bound per
    column, with ``S = Σ_rows |dy·n|`` and u the weight dtype's unit roundoff: float32 reordering ≤ 1e-5·S;
    each shard's sum rounded (≤ u·S in all); the total and the reference each rounded once (≤ u·S each)."""
    x64, dy64 = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    n64 = x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    scale = np.abs(dy64 * n64).reshape(-1, x.shape[-1]).sum(axis=0)
    u = float(jnp.finfo(want.dtype).eps) / 2
    err = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
    bad = err > (1e-5 + 3 * u) * scale
    assert not bad.any(), f"dweight off at {np.flatnonzero(bad)[:8]} (max error {err.max():.3g}, {casting=})"


def assert_no_resharding(compiled_text: str) -> None:
    found = sorted(set(RESHARDING.findall(compiled_text)))
    assert not found, f"the compiled program moves activations between devices: {found}"


def check_sharded(impl: str, mesh: Mesh, spec: P, shape, dtype, casting: str, offset: float, *, seed: int = 0,
                  with_weight: bool = True):
    """Rows sharded by ``spec``: no activation is moved; ``y``/``dx`` keep x's sharding, equal per-shard runs
    bitwise and the one-device run to a rounding of their dtype plus float32 reordering of the row sums;
    ``dweight`` is replicated, all-reduced and within its bound."""
    x, weight, dy = cpu_inputs(shape, dtype, offset, seed=seed)
    weight = weight if with_weight else None
    kw = dict(eps=1e-6, offset=offset, casting=casting)
    step = grads(impl, **kw)
    x_sh = NamedSharding(mesh, spec)
    xs, dys = jax.device_put(x, x_sh), jax.device_put(dy, x_sh)
    ws = None if weight is None else replicated(weight, mesh)
    text = step.lower(xs, ws, dys).compile().as_text()
    assert_no_resharding(text)
    y, dx, dweight = step(xs, ws, dys)
    for name, a in (("y", y), ("dx", dx)):
        assert a.sharding.is_equivalent_to(x_sh, x.ndim), f"{name} sharding {a.sharding} is not x's {x_sh}"
    y_ref, dx_ref = per_shard(lambda xb, dyb: step(xb, weight, dyb)[:2], x_sh, x, dy)
    np.testing.assert_array_equal(np.asarray(y), y_ref)
    np.testing.assert_array_equal(np.asarray(dx), dx_ref)
    y1, dx1, dweight1 = step(x, weight, dy)
    rtol = 2 * float(jnp.finfo(dtype).eps) + 4e-6
    np.testing.assert_allclose(np.asarray(y, F32), np.asarray(y1, F32), rtol=rtol, atol=rtol)
    np.testing.assert_allclose(np.asarray(dx, F32), np.asarray(dx1, F32), rtol=rtol,
                               atol=rtol * float(jnp.max(jnp.abs(dx1.astype(F32)))))
    if weight is not None:
        assert dweight.sharding.is_fully_replicated
        assert_dweight_close(dweight, dweight1, x, dy, **kw)
        assert "all-reduce" in text  # dweight's psum


@needs_4_cpus
@pytest.mark.parametrize("dtype,casting,offset", CONFIGS)
@pytest.mark.parametrize("impl", ["interpret", "xla"])
def test_batch_and_sequence_sharded(impl, dtype, casting, offset):
    mesh = make_mesh((2, 2), ("data", "seq"))
    check_sharded(impl, mesh, P("data", "seq", None), (4, 8, 160), dtype, casting, offset)


@needs_4_cpus
@pytest.mark.parametrize("with_weight", [True, False])
@pytest.mark.parametrize("impl", ["interpret", "xla"])
def test_rows_sharded_on_a_1d_mesh(impl, with_weight):
    check_sharded(impl, make_mesh((4,), ("rows",)), P("rows", None), (8, 1000), jnp.float32, "llama", 0.0, seed=1,
                  with_weight=with_weight)


@needs_4_cpus
@pytest.mark.parametrize("with_weight", [True, False])
@pytest.mark.parametrize("impl", ["interpret", "xla"])
def test_explicit_mesh_axes(impl, with_weight):
    mesh = make_mesh((2, 2), ("data", "seq"), axis_type=AxisType.Explicit)
    check_sharded(impl, mesh, P("data", "seq", None), (4, 8, 160), jnp.bfloat16, "llama", 0.0, seed=2,
                  with_weight=with_weight)


@needs_4_cpus
def test_sharded_weight_and_uneven_rows_are_resharded_not_wrong():
    mesh = make_mesh((2, 2), ("data", "seq"))
    x, weight, dy = cpu_inputs((4, 8, 160), jnp.float32, 0.0, seed=3)
    step = grads("xla")
    uneven = jax.jit(lambda x, w, dy: step(x[:3], w, dy[:3]))  # 3 rows over 'data' do not split evenly
    y, dx, dweight = uneven(*(jax.device_put(a, NamedSharding(mesh, s))
                              for a, s in ((x, P("data", "seq")), (weight, P("data")), (dy, P("data", "seq")))))
    y1, dx1, dweight1 = step(x[:3], weight, dy[:3])
    np.testing.assert_allclose(np.asarray(y), np.asarray(y1), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(dx), np.asarray(dx1), rtol=1e-6, atol=1e-5)
    assert_dweight_close(dweight, dweight1, x[:3], dy[:3], eps=1e-6, offset=0.0, casting="llama")


@needs_4_cpus
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_sharded_hidden_axis_is_refused(axis_type):
    mesh = make_mesh((2, 2), ("data", "model"), axis_type=axis_type)
    x, weight, _ = cpu_inputs((8, 1000), jnp.float32, 0.0)
    xs = jax.device_put(x, NamedSharding(mesh, P("data", "model")))
    # Explicit axes: a ValueError at trace time. Auto axes: raised by the partition rule while XLA compiles,
    # which JAX reports as a JaxRuntimeError carrying the ValueError's message.
    error = ValueError if axis_type == AxisType.Explicit else (ValueError, jax.errors.JaxRuntimeError)
    with pytest.raises(error, match=r"x of shape \(8, 1000\) has its hidden \(last\) axis sharded over mesh axis "
                                    r"'model'.*with_sharding_constraint\(x, P\(\.\.\., None\)\)"):
        jax.jit(lambda x, w: pn.rms_norm(x, w, impl="xla"))(xs, replicated(weight, mesh))


@needs_4_cpus
@pytest.mark.parametrize("impl", ["interpret", "xla"])
def test_shard_map_per_shard_matches_unsharded(impl):
    mesh = make_mesh((2, 2), ("data", "seq"))
    x, weight, dy = cpu_inputs((4, 8, 160), jnp.float32, 1.0, seed=4)
    kw = dict(eps=1e-6, offset=1.0, casting="gemma")
    # pallas_call's outputs declare no varying mesh axes, so the Pallas kernels need check_vma=False.
    norm = jax.shard_map(lambda x, w: pn.rms_norm(x, w, impl=impl, **kw), mesh=mesh,
                         in_specs=(P("data", "seq"), P()), out_specs=P("data", "seq"), check_vma=impl == "xla")

    def loss(x, w, dy):
        y = norm(x, w)
        return jnp.sum(y * dy), y

    x_sh = NamedSharding(mesh, P("data", "seq"))
    args = (jax.device_put(x, x_sh), replicated(weight, mesh), jax.device_put(dy, x_sh))
    (_, y), (dx, dweight) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(*args)
    step = grads(impl, **kw)
    y_ref, dx_ref = per_shard(lambda xb, dyb: step(xb, weight, dyb)[:2], x_sh, x, dy)
    np.testing.assert_array_equal(np.asarray(y), y_ref)
    np.testing.assert_array_equal(np.asarray(dx), dx_ref)
    assert_dweight_close(dweight, step(x, weight, dy)[2], x, dy, **kw)


@needs_4_cpus
def test_vmap_over_a_sharded_batch():
    mesh = make_mesh((2, 2), ("data", "seq"))
    x, weight, _ = cpu_inputs((4, 8, 160), jnp.float32, 0.0, seed=5)
    f = jax.jit(jax.vmap(lambda x, w: pn.rms_norm(x, w, impl="interpret"), (0, None)))
    xs, ws = jax.device_put(x, NamedSharding(mesh, P("data", "seq"))), replicated(weight, mesh)
    y = f(xs, ws)
    assert y.sharding.is_equivalent_to(xs.sharding, 3)
    assert_no_resharding(f.lower(xs, ws).compile().as_text())
    [y_ref] = per_shard(lambda xb: [f(xb, weight)], xs.sharding, x)
    np.testing.assert_array_equal(np.asarray(y), y_ref)


@needs_4_cpus
@pytest.mark.parametrize("impl", ["interpret", "xla"])
def test_single_device_use_is_the_unpartitioned_function(impl, monkeypatch):
    """Unsharded arrays: the partitioned route gives the bits of the plain one (what a 1-device process runs)."""
    x, weight, dy = cpu_inputs((2, 5, 96), jnp.bfloat16, 0.0, seed=6)
    routed = [grads(impl)(x, weight, dy), jax.vmap(lambda x: pn.rms_norm(x, weight, impl=impl))(x)]
    monkeypatch.setattr(sharding, "partitioned", lambda: False)
    plain = [grads(impl)(x, weight, dy), jax.vmap(lambda x: pn.rms_norm(x, weight, impl=impl))(x)]
    for a, b in zip(jax.tree.leaves(routed), jax.tree.leaves(plain)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@needs_4_cpus
def test_checks_catch_a_rule_without_the_dweight_psum(monkeypatch):
    monkeypatch.setattr(sharding, "psum_rows", lambda dweight, rows: dweight)
    with pytest.raises(AssertionError, match="dweight off"):
        check_sharded("xla", make_mesh((2, 2), ("data", "seq")), P("data", "seq"), (4, 8, 160), jnp.float32,
                      "llama", 0.0, seed=7)


@needs_4_cpus
def test_checks_catch_gathered_activations_without_the_rule(monkeypatch):
    monkeypatch.setattr(sharding, "partitioned", lambda: False)
    with pytest.raises(AssertionError, match="all-gather"):
        check_sharded("xla", make_mesh((2, 2), ("data", "seq")), P("data", "seq"), (4, 8, 160), jnp.float32,
                      "llama", 0.0, seed=8)


def gpus() -> list:
    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        devices = []
    if len(devices) < 2:
        pytest.skip(f"needs 2 GPUs, JAX sees {len(devices)}")
    return devices[:2]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,casting,offset", CONFIGS)
def test_gpu_rows_sharded_match_one_device(dtype, casting, offset):
    devices = gpus()
    mesh = make_mesh((2,), ("data",), devices)
    x, weight, dy = jax_inputs((4, 256, 1024), dtype, offset, seed=9)
    kw = dict(eps=1e-6, offset=offset, casting=casting)
    step = grads("pallas", **kw)
    x_sh = NamedSharding(mesh, P("data"))
    args = (jax.device_put(x, x_sh), jax.device_put(weight, NamedSharding(mesh, P())), jax.device_put(dy, x_sh))
    y, dx, dweight = step(*args)
    assert y.sharding.is_equivalent_to(x_sh, 3) and dx.sharding.is_equivalent_to(x_sh, 3)
    assert dweight.sharding.is_fully_replicated
    y1, dx1, dweight1 = step(*(jax.device_put(a, devices[0]) for a in (x, weight, dy)))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y1))
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(dx1))
    assert_dweight_close(dweight, dweight1, x, dy, **kw)
    assert_no_resharding(step.lower(*args).compile().as_text())


@pytest.mark.gpu
def test_gpu_shard_map_matches_one_device():
    devices = gpus()
    mesh = make_mesh((2,), ("data",), devices)
    x, weight, dy = jax_inputs((2, 512, 1024), jnp.bfloat16, 0.0, seed=10)
    norm = jax.shard_map(lambda x, w: pn.rms_norm(x, w, impl="pallas"), mesh=mesh, in_specs=(P("data"), P()),
                         out_specs=P("data"), check_vma=False)
    y, vjp = jax.vjp(jax.jit(norm), x, weight)
    dx, dweight = vjp(dy)
    y1, dx1, dweight1 = grads("pallas")(*(jax.device_put(a, devices[0]) for a in (x, weight, dy)))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y1))
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(dx1))
    assert_dweight_close(dweight, dweight1, x, dy, eps=1e-6, offset=0.0, casting="llama")
